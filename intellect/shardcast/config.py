"""Configs of SHARDCAST's parts: the client, a relay, and what an RL run starts locally."""

from __future__ import annotations

from pydantic import Field

from intellect.config import StrictModel
from intellect.shardcast.patch import MAX_CHAIN

LOOPBACK = "127.0.0.1"
PUBLIC_KEY_HEX = r"^[0-9a-f]{64}$"
MIB = 1 << 20

_TRAINER_KEY = ("The trainer's Ed25519 public key (64 hex digits; intellect.trust.keys): only versions it signed are "
                "trusted, mirrored or exposed. Required: there is no unsigned mode.")
_MANIFEST_BYTES = ("Bytes a manifest answer may have; a longer one is refused before it is parsed, and its server "
                   "marked bad. The default holds ~24,000 signed shard entries of ~345 bytes: a 390 GB checkpoint "
                   "in 16 MiB shards.")
_VERSIONS_BYTES = "Bytes a /versions answer may have (it lists the newest few versions, each with its signed header)."


class ClientTuning(StrictModel):
    """How a client downloads a version from relays (all but the trainer's key: :class:`ClientConfig`)."""

    parallel: int = Field(
        default=4, ge=1, le=256, description="Shards downloaded at once. More threads fight over the GIL on fast "
        "links; slow links want more.")
    attempts: int = Field(default=5, ge=1, le=100, description="Tries per shard (each from a relay picked afresh).")
    deadline: float = Field(default=600.0, gt=0, le=86400, description="Seconds for a whole version, waiting included.")
    connect_timeout: float = Field(default=5.0, gt=0, le=600, description="Seconds to open a connection to a relay.")
    read_timeout: float = Field(
        default=30.0, gt=0, le=3600, description="Seconds a relay may stay silent mid-request before the try fails."
    )
    poll_interval: float = Field(
        default=0.05, gt=0, le=60, description="Seconds between looks at the relays' manifests while a version is incomplete."
    )
    min_rate: float = Field(
        default=65536.0, gt=0, le=1e12, description="Bytes/s under which a JSON answer (a listing, a manifest) is abandoned: "
        "each may take read_timeout + any long poll + its byte cap / min_rate seconds in all (a listing: 46 s by "
        "default, and no more than deadline), so a relay that sends a byte now and then cannot hold a call.")
    alpha: float = Field(default=0.3, gt=0, le=1, description="EMA weight of the newest observation (INTELLECT-2: 0.3).")
    heal: float = Field(
        default=0.01, ge=0, le=1, description="Success-rate points every relay regains per observation, so a failed relay "
        "is tried again over time (INTELLECT-2: 0.01)."
    )
    seed: int | None = Field(default=None, ge=0, description="Seed of the relay choice; None: random.")
    reread: bool = Field(
        default=False, description="Hash the assembled files once more before exposing them. Off: shards checked by their "
        "SHA-256 chaining values already prove the whole checkpoint's SHA-256 (one hash pass, not two); on: "
        "also catches a fault between memory and the files (a bad disk), for one more pass.")
    max_manifest_bytes: int = Field(default=8 * MIB, ge=4096, le=1 << 30, description=_MANIFEST_BYTES)
    max_versions_bytes: int = Field(default=MIB, ge=1024, le=64 * MIB, description=_VERSIONS_BYTES)


class ClientConfig(ClientTuning):
    """A client: its tuning and the trainer's key it pins."""

    trainer_key: str = Field(pattern=PUBLIC_KEY_HEX, description=_TRAINER_KEY)


class RelayConfig(StrictModel):
    """A relay: mirrors the newest versions of its upstreams and serves what it holds, once verified."""

    upstreams: list[str] = Field(min_length=1, max_length=64, description="Base URLs of the origin or other relays.")
    trainer_key: str = Field(pattern=PUBLIC_KEY_HEX, description=_TRAINER_KEY)
    keep: int = Field(default=5, ge=1, le=1000, description="Newest versions kept; older ones are deleted.")
    parallel: int = Field(default=4, ge=1, le=256, description="Shards fetched from upstream at once (see ClientConfig).")
    poll_interval: float = Field(default=0.05, gt=0, le=60, description="Seconds between looks at the upstreams.")
    connect_timeout: float = Field(default=5.0, gt=0, le=600, description="Seconds to open a connection upstream.")
    read_timeout: float = Field(default=30.0, gt=0, le=3600, description="Seconds an upstream may stay silent mid-request.")
    min_rate: float = Field(
        default=65536.0, gt=0, le=1e12, description="Bytes/s under which a shard's download is abandoned and fetched again "
        "on a later pass: each may take read_timeout + its size / min_rate seconds in all (16 MiB: 286 s by default), "
        "so an upstream that sends a byte now and then cannot hold a download thread. A JSON answer (a listing, a "
        "manifest) likewise may take read_timeout + any long poll + its byte cap / min_rate seconds.")
    max_manifest_bytes: int = Field(default=8 * MIB, ge=4096, le=1 << 30, description=_MANIFEST_BYTES)
    max_versions_bytes: int = Field(default=MIB, ge=1024, le=64 * MIB, description=_VERSIONS_BYTES)
    distrust_seconds: float = Field(
        default=300.0, gt=0, le=86400, description="Seconds an upstream that served unsigned, mis-signed, oversized or "
        "malformed data is not asked (it is asked again afterwards, and marked bad again at its first lie).")


class ShardcastConfig(StrictModel):
    """SHARDCAST in an RL run: the trainer publishes each checkpoint to an origin, workers download
    it from relays. With ``relays`` unset the run starts an origin and ``local_relays`` relays on
    ``host`` itself (the one-machine default)."""

    shard_size: int = Field(default=16 << 20, ge=1 << 10, le=1 << 30, description="Bytes per shard.")
    keep: int = Field(
        default=5, ge=1, le=1000, description="Newest versions the origin and relays keep (and, for those that are "
        "weight patches, their bases down to the last full version: at most keep + anchor_every - 1 in all).")
    anchor_every: int = Field(
        default=10, ge=1, le=MAX_CHAIN, description="Every anchor_every-th version the trainer publishes is the full "
        "checkpoint; the others are weight patches against the version before (the bf16 elements whose bits "
        "changed, intellect.shardcast.patch). A worker that lacks a patch's base rebuilds from the last full "
        "version, downloading up to anchor_every - 1 patches after it. 1: every version full.")
    host: str = Field(default=LOOPBACK, description="Address the local origin and relays listen on.")
    origin_port: int = Field(default=0, ge=0, le=65535, description="Port of the local origin (0: any free one).")
    local_relays: int = Field(default=2, ge=0, le=64, description="Relays the run starts locally (when relays is unset).")
    relays: list[str] | None = Field(
        default=None, max_length=256, description="Base URLs of relays run elsewhere; the run then starts none and the "
        "origin is expected to be reachable by them at http://host:origin_port."
    )
    client: ClientTuning = Field(
        default_factory=ClientTuning, description="Workers' client settings; the trainer's key is the run's own.")
