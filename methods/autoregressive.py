"""Autoregressive decoding: one token per target forward. The speed baseline and the losslessness reference."""

from __future__ import annotations

import torch

from methods.base import Generation, Method, Timer, register
from methods.capabilities import Reports
from methods.sampling import Sampler


@register
class Autoregressive(Method, Reports):
    name = "autoregressive"

    @classmethod
    def theoretical_speedup(cls, summary) -> float:
        return 1.0  # the baseline every speedup is relative to

    @classmethod
    def modeled_speedup(cls, summary) -> float:
        return 1.0

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampler: Sampler) -> Generation:
        target = self.target
        target.reset()
        timer = Timer(target.device)
        with timer("prefill"):
            logits, _ = target.forward(torch.tensor(prompt_ids), start=0, last=True)
            next_id = sampler.next_token(logits[-1])
            token = int(next_id)
        output = [token]
        with timer("decode"):  # the token goes back in as the tensor it came out as: one read per token
            while len(output) < max_new_tokens and token not in self.stop_ids:
                position = len(prompt_ids) + len(output) - 1
                logits, _ = target.forward(next_id, start=position)
                next_id = sampler.next_token(logits[-1])
                token = int(next_id)
                output.append(token)
        steps = len(output) - 1
        return Generation(output_ids=output, steps=steps, accepted=[1] * steps, timing=timer.totals)
