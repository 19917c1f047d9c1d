"""Turns token bytes into text a client can show: whole UTF-8 characters, stop strings cut.

A token may end in the middle of a multibyte character and a stop string may span tokens,
so text is held back until it can no longer turn into either.
"""

from __future__ import annotations

import codecs


class TextStream:
    def __init__(self, stops: list[str]) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, data: bytes) -> str:
        """Returns the text that is safe to emit now; sets `stopped` when a stop string hit."""
        if self.stopped:
            return ""
        self._held += self._decoder.decode(data)
        return self._release()

    def finish(self) -> str:
        """End of generation: flush what was held (an unfinished stop prefix is just text).

        Bytes of a character the token limit cut in half are dropped, not shown as U+FFFD.
        """
        if self.stopped:
            return ""
        self._decoder.reset()
        out, self._held = self._held, ""
        return out

    def _release(self) -> str:
        if not self._stops:
            out, self._held = self._held, ""
            return out
        cut = min((i for i in (self._held.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self._held = self._held[:cut], ""
            return out
        keep = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._held)), 0, -1):
                if self._held.endswith(stop[:n]):
                    keep = max(keep, n)
                    break
        split = len(self._held) - keep
        out, self._held = self._held[:split], self._held[split:]
        return out
