"""What an inference engine has run: forwards, rows, tokens, weight updates."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class EngineStats:
    """What an engine's ``generate`` and ``update_weights`` have run, summed over calls (``reset`` to start over).

    A *row-step* is one row of one forward that yields next-token logits: a prompt in a prefill
    forward, or a row of a decode forward. Each returned token took one, so ``useful_share`` is 1
    when no forward carries a finished row, and less for static batches whose short rows wait
    for the longest.
    """

    prefill_forwards: int = 0
    prefill_rows: int = 0
    decode_forwards: int = 0
    decode_rows: int = 0
    tokens: int = 0  # returned, EOS included
    peak_rows: int = 0  # most rows decoding at once
    peak_reserved_tokens: int = 0  # most len(prompt) + max_tokens summed over rows decoding at once
    weight_updates: int = 0  # new policies loaded into the running engine (update_weights), never a rebuild
    weight_update_seconds: float = 0.0  # wall time of those updates, reading the folder included

    @property
    def row_steps(self) -> int:
        return self.prefill_rows + self.decode_rows

    @property
    def useful_share(self) -> float:
        """Returned tokens per row-step (1.0 before any)."""
        return self.tokens / self.row_steps if self.row_steps else 1.0

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)

    def updated(self, seconds: float) -> None:
        """One in-place weight update that took ``seconds``."""
        self.weight_updates, self.weight_update_seconds = self.weight_updates + 1, self.weight_update_seconds + seconds

    def prefilled(self, rows: int, running: int, reserved: int) -> None:
        """A prefill forward of ``rows`` prompts, after which ``running`` rows reserving ``reserved``
        tokens decode."""
        self.prefill_forwards, self.prefill_rows = self.prefill_forwards + 1, self.prefill_rows + rows
        self.peak_rows, self.peak_reserved_tokens = max(self.peak_rows, running), max(self.peak_reserved_tokens, reserved)

    def decoded(self, rows: int) -> None:
        self.decode_forwards, self.decode_rows = self.decode_forwards + 1, self.decode_rows + rows
