"""`Engine`: batched generation, synchronous, over the scheduler.

`Engine.generate(prompts, sampling)` queues every prompt on a `Scheduler` (the same request
layer, programs and speculation policy the server runs) and steps it until all are done, at most
`max_batch_size` running at once; outputs come back in prompt order. The scheduler (and its
compiled programs) lives as long as the Engine, so later calls reuse them.
"""

from __future__ import annotations

from typing import Sequence

from .draft import Draft
from .request import RequestOutput
from .sampling import SamplingParams
from .scheduler import Scheduler
from .spec_decode.settings import AutoSpec, SpecConfig
from .target import Target
from .tokenizer import Tokenizer


class Engine:
    """Batched generation over a target: EAGLE-3 speculation with a draft, plain decoding without.

    spec: a SpecConfig (default chain 3/1/4 with a draft) or `SpecConfig.auto(...)`.
    max_batch_size: sequences decoded together; max_seq_len: prompt + generated tokens per sequence.
    tokenizer: lets requests stop at stop strings (`SamplingParams.stop`) and outputs carry their
    text (`RequestOutput.text`).
    """

    def __init__(self, target: Target, draft: Draft | None = None, spec: SpecConfig | AutoSpec | None = None,
                 max_batch_size: int = 8, max_seq_len: int = 2048, tokenizer: Tokenizer | None = None):
        if not isinstance(max_batch_size, int) or not isinstance(max_seq_len, int) or max_batch_size < 1 \
                or max_seq_len < 2:
            raise ValueError(f"max_batch_size must be >= 1 and max_seq_len >= 2; got {max_batch_size}, {max_seq_len}")
        self.scheduler = Scheduler(target, draft, spec, max_num_seqs=max_batch_size, max_seq_len=max_seq_len,
                                   tokenizer=tokenizer)
        self.target, self.draft, self.spec = target, self.scheduler.draft, self.scheduler.spec
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (a list of token ids); returns outputs in prompt order. A
        max_tokens that does not fit in max_seq_len is cut to the room left, with a warning."""
        return self.scheduler.generate(prompts, sampling)
