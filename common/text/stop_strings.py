"""Stop strings over streamed text: generation ends at the first occurrence of any of them,
and the text sent stops right before it.

Text that could still become the start of a stop string is held back, never sent and then
taken back; the held text is always shorter than the longest stop string, so each piece costs
O(len(piece) + longest stop string), independent of how much text came before.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopCheck:
    text: str  # safe to send now
    stopped: bool  # a stop string was found; text ends right before it


class StopStrings:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self.held = ""

    def feed(self, piece: str) -> StopCheck:
        """The next piece of streamed text -> what may be sent, and whether to stop."""
        if not self.stops:
            return StopCheck(piece, False)
        buf = self.held + piece
        found = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if found:
            self.held = ""
            return StopCheck(buf[:min(found)], True)
        keep = self._longest_partial_suffix(buf)
        self.held = buf[len(buf) - keep:] if keep else ""
        return StopCheck(buf[:len(buf) - keep], False)

    def finish(self, piece: str = "") -> StopCheck:
        """The end of the text: whatever was held back is sent (unless a stop string ends it)."""
        check = self.feed(piece)
        if check.stopped:
            return check
        text, self.held = check.text + self.held, ""
        return StopCheck(text, False)

    def _longest_partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
