"""The one home of the project's cryptography: every signature, MAC and key file goes through here.

* :mod:`intellect.trust.canonical`: the unambiguous byte strings that are signed or MAC'd;
* :mod:`intellect.trust.keys`: Ed25519 signing and verify keys, key files (mode 0600), key ids;
* :mod:`intellect.trust.requests`: signed HTTP requests with timestamp and nonce replay protection;
* :mod:`intellect.trust.mac`: HMAC-SHA256 tags and per-purpose key derivation from a shared secret.

``rl``, ``shardcast`` and ``diloco`` import these and never hand-roll their own.
"""
