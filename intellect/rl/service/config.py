"""The submission service's configuration: where it listens, what it admits, and every cap and deadline
that bounds what one client can hold (:mod:`intellect.rl.service.server` explains how each is enforced)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from intellect.config import StrictModel
from intellect.rl.service.http import SPILL
from intellect.rl.wire.work import MAX_BITS
from intellect.trust.keys import VerifyKey

__all__ = ["ServiceConfig"]


class ServiceConfig(StrictModel):
    """Where the submission service listens and what it admits."""

    host: str = Field(default="127.0.0.1", min_length=1, max_length=255,
                      description="Listen address; 127.0.0.1 keeps the service on this machine.")
    port: int = Field(default=0, ge=0, le=65535, description="Listen port; 0 picks a free one.")
    admission: Literal["allowlist", "open"] = Field(
        default="open",
        description="allowlist: only the keys in `allowlist`; open: any key, registrations rate-limited.")
    allowlist: list[str] = Field(default_factory=list, max_length=1 << 16,
                                 description="Hex Ed25519 public keys admitted in allowlist mode.")
    registrations_per_minute: int = Field(
        default=10, ge=1, le=1 << 20,
        description="New keys admitted per address prefix (IPv4 /24, IPv6 /48) per minute (open).")
    registrations_per_minute_total: int = Field(default=120, ge=1, le=1 << 24,
                                                description="New keys admitted per minute from all addresses (open).")
    registration_reserve: float = Field(
        default=0.5, ge=0, lt=1,
        description="Share of registrations_per_minute_total kept for address prefixes that used less than half "
        "of their own registrations_per_minute lately: a few prefixes cannot drain the total.")
    registration_work_bits: int = Field(
        default=20, ge=0, le=MAX_BITS,
        description="Leading zero bits of the proof of work a new key must bring in open admission "
                    "(intellect.rl.wire.work; 2**bits hashes on average, about a generation step; 0: none).")
    max_workers: int = Field(default=10_000, ge=1, le=1 << 24, description="Most admitted workers.")
    worker_expiry: float = Field(default=3600.0, ge=1, le=365 * 86400,
                                 description="Seconds after which an admitted key that stored nothing may be "
                                             "dropped to admit a new one when `max_workers` are admitted.")
    max_body_bytes: int = Field(default=64 << 20, ge=1024, le=1 << 40, description="Largest upload (one Parquet file).")
    max_submission_bytes: int | None = Field(
        default=None, ge=1024, le=1 << 40,
        description="Largest submission a worker may declare (upload or S3 declaration), at most max_body_bytes; "
        "None: an RL run's largest possible submission (rows x tokens x the rollout schema's bytes, "
        "RLRunConfig.service_config), max_body_bytes for a service started on its own.")
    max_json_bytes: int = Field(default=64 << 10, ge=1024, le=SPILL, description="Largest JSON body.")
    max_concurrent_uploads: int = Field(
        default=16, ge=1, le=4096,
        description="Uploads read at once (one per key), shared fairly among address prefixes: when all are taken, "
        "a prefix holding fewer displaces the newest upload of the prefix holding the most; else busy.")
    upload_reserve: int = Field(
        default=4, ge=0, le=4095,
        description="Of max_concurrent_uploads, the slots only keys with accepted samples may take (at most all "
        "but one).")
    max_uploads_per_prefix: int = Field(
        default=8, ge=1, le=4096,
        description="Uploads read at once from one address prefix (IPv4 /24, IPv6 /48).")
    max_worker_step_bytes: int = Field(default=512 << 20, ge=1024, le=1 << 44,
                                       description="Bytes one worker may store (or declare, S3) per step.")
    max_spool_bytes: int = Field(default=1 << 30, ge=1024, le=1 << 44,
                                 description="Declared bytes of the uploads being read at once.")
    min_free_bytes: int = Field(default=256 << 20, ge=0, le=1 << 44,
                                description="Free disk an upload must leave in the spool and local run storage.")
    min_body_rate: int = Field(
        default=64 << 10, ge=1, le=1 << 34,
        description="Bytes per second a body must keep up with from its first byte: a body of n bytes is in "
        "within body_grace + 1 + n / min_body_rate seconds, and one that falls behind is cut as soon as it does.")
    body_grace: float = Field(
        default=10.0, gt=0, le=3600, description="Seconds a body may take to begin (its first byte).",
    )
    header_timeout: float = Field(default=10.0, gt=0, le=3600,
                                  description="Seconds a request head (line and headers) may take to arrive.")
    max_connections: int = Field(
        default=1024, ge=8, le=1 << 16,
        description="Open connections, shared fairly among address prefixes: when all are taken, a new one "
        "displaces one of the prefix holding the most, if that holds more than the newcomer's; else it is closed.")
    connection_reserve: int = Field(
        default=128, ge=0, le=(1 << 16) - 1,
        description="Of max_connections, those kept for address prefixes a key with accepted samples called from "
        "(at most all but one).")
    max_connections_per_prefix: int = Field(
        default=64, ge=1, le=1 << 16,
        description="Open connections per address prefix (IPv4 /24, IPv6 /48).")
    replay_per_key: int = Field(default=4096, ge=16, le=1 << 20,
                                description="Signed requests of one key remembered by the replay guard "
                                            "(2 x request_window); more are refused as busy.")
    request_window: float = Field(default=30.0, ge=1, le=3600,
                                  description="Seconds a signed request's timestamp may be off the service's clock.")
    max_submissions_per_step: int | None = Field(
        default=None, ge=1, le=1 << 16, description="Submissions per worker per step; None: an RL run's "
        "workers.max_submissions (RLRunConfig.service_config), 64 for a service started on its own.")
    ahead: int | None = Field(
        default=None, ge=0, le=1 << 20, description="Steps past the newest committed one a worker may submit for; "
        "None: an RL run's async_level + 1, 2 for a service started on its own.")
    presign_expiry: int = Field(
        default=120, ge=1, le=86400,
        description="Seconds a name's presigned POSTs stay valid, from its declaration (S3). The validator reads "
        "an object only after its window, so this is also the delay before a step's S3 files are validated.")

    @field_validator("allowlist")
    @classmethod
    def _keys(cls, keys: list[str]) -> list[str]:
        return [VerifyKey.from_hex(k.lower()).hex for k in keys]

    def submission_cap(self) -> int:
        """The largest submission a worker may declare."""
        return min(self.max_body_bytes, self.max_submission_bytes or self.max_body_bytes)
