"""EAGLE-3 on tiny models: token-identical to greedy AR at T=0 (chains and trees, any head quality), the target
distribution at T=1, and the training-time-test forward equal to the rows the decoder drafts with."""

import pytest
import torch
from tiny_models import flat_target, sampled_joint_tv, tiny_model

from harness.runtime.target import TargetRuntime
from methods.base import build_method
from methods.eagle3.head import EagleConfig, EagleHead, HeadSession, ttt_logits
from methods.eagle3.method import EAGLE3, EagleParams
from methods.rounds import Node
from methods.sampling import Sampler, SamplingConfig

GREEDY = SamplingConfig()


def _eagle(model, m=3, width=1, max_len=256):
    target = TargetRuntime(model, max_len=max_len)
    head = EagleHead(EagleConfig(ttt=3, num_layers=model.config.num_hidden_layers), target).eval()
    return target, EAGLE3(target, EagleParams(m=m, width=width, ttt=3), set(), head=head)


class Oracle(EAGLE3):
    """Proposes the greedy reference token first with probability `hit_rate` wherever the branch is still right."""

    def __init__(self, inner: EAGLE3, reference: dict[int, int], hit_rate: float):
        self.__dict__.update(inner.__dict__)
        self.reference, self.hit_rate = reference, hit_rate
        self.rng = torch.Generator().manual_seed(0)

    def _draft_logits(self, states, base, depth):
        logits = super()._draft_logits(states, base, depth).clone()
        right = self.reference.get(base + depth)
        for row in range(len(logits)):
            if right is not None and float(torch.rand((), generator=self.rng)) < self.hit_rate:
                logits[row] = -10.0
                logits[row, right] = 10.0
        return logits


@pytest.mark.parametrize("arch, width", [("llama", 1), ("qwen3", 1), ("qwen3_5", 1), ("llama", 4), ("qwen3", 4),
                                         ("qwen3_5", 2), ("qwen3_5", 4)])
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("hit_rate", [0.0, 0.7, 1.0])
def test_greedy_output_is_token_identical_to_ar(arch, width, m, hit_rate):
    model = tiny_model(arch)
    target, method = _eagle(model, m, width)
    ar = build_method("autoregressive", target, {}, set())
    for prompt in ([7], [3, 4], list(range(10, 19))):
        reference = ar.generate(prompt, 24, Sampler(GREEDY)).output_ids
        oracle = Oracle(method, {len(prompt) + i: t for i, t in enumerate(reference)}, hit_rate)
        generation = oracle.generate(prompt, 24, Sampler(GREEDY))
        assert generation.output_ids == reference
        assert sum(generation.accepted) == len(reference) - 1
        if hit_rate == 1.0:  # every round accepts all m drafts plus the bonus token
            assert generation.steps == -(-(len(reference) - 1) // (m + 1))
            assert generation.position_accepts[0] == generation.steps


def test_a_tree_rescues_a_wrong_first_choice():
    """Width 4 verifies the runner-up branch in the same forward; a chain would lose the round."""
    model = tiny_model("llama")
    prompt = [5, 6, 7]
    steps = {}
    for width in (1, 4):
        target, method = _eagle(model, 3, width)
        reference = build_method("autoregressive", target, {}, set()).generate(prompt, 17, Sampler(GREEDY)).output_ids
        by_position = {len(prompt) + i: t for i, t in enumerate(reference)}

        class SecondBest(Oracle):
            def _draft_logits(self, states, base, depth):
                logits = torch.zeros(states.shape[1], model.config.vocab_size)
                right = self.reference.get(base + depth, 0)
                logits[:, right] = 10.0
                logits[:, (right + 1) % logits.shape[-1]] = 11.0 if depth == 1 else 0.0
                return logits

        generation = SecondBest(method, by_position, 1.0).generate(prompt, 17, Sampler(GREEDY))
        assert generation.output_ids == reference
        steps[width] = generation.steps
    assert steps[4] == 4  # 16 tokens, 4 per round: the runner-up branch is accepted every time
    assert steps[1] == 16  # the chain's first draft always fails


@pytest.mark.parametrize("arch, width", [("llama", 1), ("llama", 4), ("qwen3_5", 1), ("qwen3_5", 2), ("qwen3_5", 4)])
def test_sampled_tokens_follow_the_target_distribution(arch, width):
    vocab = 4
    model = flat_target(vocab, arch)
    _, method = _eagle(model, m=2, width=width)
    with torch.no_grad():  # a head far from the target, so a wrong rule would show
        method.head.head.weight.copy_(torch.randn(vocab, 64, generator=torch.Generator().manual_seed(0)))
    assert sampled_joint_tv(method, model, vocab) < 0.07


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_training_time_test_equals_the_rows_the_decoder_drafts_with(arch):
    """Same tokens: step k of the training forward gives the logits the decoder computes for its k-th draft."""
    model = tiny_model(arch)
    target, method = _eagle(model)
    head = method.head
    with torch.no_grad():  # away from the pass-through init, so every input matters
        for p in head.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    ids = torch.tensor([[4, 9, 2, 7, 1, 8, 3, 5, 6, 11, 12, 13]])
    _, features = target.forward(ids[0], 0, head.config.all_feature_layers())
    expected = ttt_logits(head, features, ids, 3)
    for t in (0, 4, 7):  # chain roots: the target verified tokens up to t + 1
        target_rows = {layer: h[:, : t + 1] for layer, h in features.items()}
        state = HeadSession(head, 64)
        state.append(ids[0, 1 : t + 2].tolist(), target_rows, start=1)
        assert (head.head_logits(state.root)[0, 0] - expected[0][0, t]).abs().max() < 1e-4
        nodes = [Node(int(ids[0, t + 2]), -1, 1), Node(int(ids[0, t + 3]), 0, 2)]
        for k, node in enumerate(nodes):
            node.state = state.draft_rows(nodes, [k], base=t + 1)
            assert (head.head_logits(node.state)[0, 0] - expected[k + 1][0, t]).abs().max() < 1e-4
