"""How many of the drafts a lookup found a round offers, from what a verify forward costs and what matches earn.

A round that offers d drafts costs a target forward over d + 1 tokens, costs[d] times a one-token step (measured on
this target before decoding). If each draft is accepted with probability a once the one before it was, it commits
1 + a + ... + a^d tokens in expectation. The round offers the d (up to what was found) with the most expected tokens
per unit of cost; d = 0 is a plain autoregressive step. The rate a is counted per matched suffix length (a longer
match predicts better) over this generation's rounds so far, starting from an even prior.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Beta prior of each suffix length's acceptance rate, in drafts: an even start that two or three rounds outweigh.
PRIOR_ACCEPTED = 1.0
PRIOR_TRIED = 2.0


def expected_tokens(rate: float, drafts: int) -> float:
    """Tokens a round of `drafts` chained drafts commits in expectation: the accepted drafts and one more."""
    return sum(rate**i for i in range(drafts + 1))


@dataclass
class DraftLength:
    costs: list[float]  # costs[t - 1]: a forward over t tokens over a one-token forward
    accepted: dict[int, int] = field(default_factory=dict)  # suffix length -> drafts accepted
    tried: dict[int, int] = field(default_factory=dict)  # suffix length -> drafts judged (up to the first rejection)

    def rate(self, size: int) -> float:
        return (self.accepted.get(size, 0) + PRIOR_ACCEPTED) / (self.tried.get(size, 0) + PRIOR_TRIED)

    def choose(self, found: int, size: int) -> int:
        """Drafts to offer of the `found` a suffix of `size` tokens matched."""
        rate, most = self.rate(size), min(found, len(self.costs) - 1)
        return max(range(most + 1), key=lambda d: expected_tokens(rate, d) / self.costs[d])

    def record(self, size: int, offered: int, accepted: int) -> None:
        """A round offered `offered` drafts matched by a suffix of `size` tokens and `accepted` of them were kept."""
        self.accepted[size] = self.accepted.get(size, 0) + accepted
        self.tried[size] = self.tried.get(size, 0) + min(offered, accepted + 1)
