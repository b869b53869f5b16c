"""Tiny random models of the three supported architectures, built offline from configs."""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3_5TextConfig, Qwen3Config

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def tiny_config(arch: str, num_layers: int = 6, vocab_size: int = 256):
    kw = {**COMMON, "num_hidden_layers": num_layers, "vocab_size": vocab_size}
    if arch == "llama":
        return LlamaConfig(**kw)
    if arch == "qwen3":
        return Qwen3Config(**kw)
    if arch == "qwen3_5":
        kinds = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
        return Qwen3_5TextConfig(
            **kw,
            layer_types=[kinds[i % 4] for i in range(num_layers)],
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
        )
    raise ValueError(arch)


def tiny_model(arch: str, num_layers: int = 6, vocab_size: int = 256, seed: int = 0, dtype=torch.float32):
    """Initialised in fp32, then converted to `dtype`."""
    torch.manual_seed(seed)
    config = tiny_config(arch, num_layers, vocab_size)
    config._attn_implementation = "sdpa"
    with torch.inference_mode(False):  # weights with version counters, as load_model makes them (the CPU kernels)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # Random init leaves tiny logit gaps; scaling the head makes greedy choices well separated in fp32.
        with torch.no_grad():
            model.lm_head.weight.mul_(4.0)
        model.to(dtype)
    return model.eval()


def flat_target(vocab: int, arch: str = "llama"):
    """A tiny model with a flattened head at T=1, so every outcome of the first tokens is likely. Four layers, the
    fewest that hold each architecture's every layer kind (Qwen3.5: three linear, one full): a distribution test
    decodes it 1,000-1,500 times, and its cost goes with the layers."""
    model = tiny_model(arch, num_layers=4, vocab_size=vocab)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    return model


def sampled_joint_tv(method, model, vocab: int, runs: int = 1500, prompt=(1, 2, 3)) -> float:
    """TV distance between the method's empirical joint of generated tokens 1 and 2 at T=1 and the exact one."""
    from methods.sampling import Sampler, SamplingConfig

    prompt = list(prompt)
    expected = exact_joint_of_tokens_1_and_2(model, prompt, vocab)
    counts = torch.zeros(vocab * vocab)
    for seed in range(runs):
        out = method.generate(prompt, 3, Sampler(SamplingConfig(temperature=1.0), torch.Generator().manual_seed(seed)))
        counts[out.output_ids[1] * vocab + out.output_ids[2]] += 1
    return 0.5 * float((counts / runs - expected).abs().sum())


def exact_joint_of_tokens_1_and_2(model, prompt: list[int], vocab: int) -> torch.Tensor:
    """P(x1, x2) under the target at T=1, marginalising the prefill token x0, by enumerating all continuations."""
    seqs = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
    probs = torch.softmax(model(seqs).logits.float(), dim=-1)  # [V*V, len, V]
    p0 = probs[0, len(prompt) - 1]
    joint = torch.zeros(vocab, vocab)
    for a in range(vocab):
        p1 = probs[a * vocab, len(prompt)]
        for b in range(vocab):
            joint[b] += p0[a] * p1[b] * probs[a * vocab + b, len(prompt) + 1]
    return joint.flatten()
