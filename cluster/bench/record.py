"""`RequestRecord`: what the load generator's client saw for one request (send time, each token-carrying
chunk's arrival and token count, the end, usage, error, the server's timeline).

Who uses it: `loadgen.py` fills one per request; `metrics.py` (latencies, attainment, summaries) and
`qoe.py` (token arrivals against a reader's pace) read it; `report.py` writes it out. A module of its own
so that both readers import it and neither imports the other back.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """What the client saw for one request; times are seconds since the run started (monotonic clock)."""
    index: int
    arrival_s: float  # when it was scheduled to be sent
    input_len: int  # prompt tokens asked for
    max_tokens: int  # output tokens asked for
    sent_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)  # arrival time of each chunk carrying tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in that chunk (1 per text chunk if unknown)
    end_s: float | None = None
    output_tokens: int = 0  # usage.completion_tokens when the server reports it, else counted chunks
    prompt_tokens: int | None = None  # usage.prompt_tokens
    finish_reason: str | None = None
    error: str | None = None
    timeline: dict[str, float] | None = None  # server events (unix times), pdserve only
    sent_unix: float | None = None  # wall-clock send time, to place the timeline next to client times

    @property
    def ok(self) -> bool:
        return self.error is None and self.sent_s is not None and bool(self.chunk_s) and self.output_tokens > 0
