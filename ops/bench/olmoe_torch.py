"""PyTorch reference for the trainer benchmark: Hugging Face OlmoeForCausalLM with the config
the trainer's preset describes, AdamW, clipping at 1.0, fp32, on N threads, the same batch
shape. Prints one JSON line of figures. Exits 3 with a message when torch or transformers is
missing, so the caller can report the comparison as skipped.

    python3 ops/bench/olmoe_torch.py --model-json MODEL.json --micro-batch 8 --threads 2
"""

import argparse
import json
import sys
import time


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-json", required=True,
                        help="the trainer's [model] section as JSON (trainer bench writes it)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    try:
        import torch
        from transformers import OlmoeConfig, OlmoeForCausalLM
    except ImportError as missing:
        print(f"skipped: {missing}", file=sys.stderr)
        sys.exit(3)

    with open(args.model_json) as f:
        model = json.load(f)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = OlmoeConfig(
        vocab_size=model["vocab_size"],
        hidden_size=model["d_model"],
        intermediate_size=model["expert_ffn"],
        num_hidden_layers=model["layers"],
        num_attention_heads=model["heads"],
        num_key_value_heads=model["heads"],
        num_experts=model["experts"],
        num_experts_per_tok=model["top_k"],
        norm_topk_prob=False,
        max_position_embeddings=model["seq_len"],
        rope_theta=model["rope_theta"],
        rms_norm_eps=model["norm_eps"],
        router_aux_loss_coef=model["router_aux_coef"],
        output_router_logits=True,
        tie_word_embeddings=False,
        attention_bias=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    net = OlmoeForCausalLM(config).float().train()
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  eps=1e-8, weight_decay=0.1)
    seq = model["seq_len"]
    generator = torch.Generator().manual_seed(1)
    phases = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    measured_tokens = 0
    started = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            phases = {key: 0.0 for key in phases}
            started = time.perf_counter()
        tokens = torch.randint(0, model["vocab_size"] - 1, (args.micro_batch, seq + 1),
                               generator=generator)
        t0 = time.perf_counter()
        out = net(input_ids=tokens[:, :-1], labels=tokens[:, 1:].contiguous(),
                  shift_labels=tokens[:, 1:].contiguous())
        t1 = time.perf_counter()
        out.loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        phases["forward"] += t1 - t0
        phases["backward"] += t2 - t1
        phases["optimizer"] += t3 - t2
        if step >= args.warmup:
            measured_tokens += args.micro_batch * seq
    elapsed = time.perf_counter() - started
    print(json.dumps({
        "implementation": f"torch {torch.__version__} + transformers OlmoeForCausalLM",
        "threads": args.threads,
        "steps": args.steps,
        "tokens_per_second": measured_tokens / elapsed,
        "step_ms": 1000 * elapsed / args.steps,
        "forward_ms": 1000 * phases["forward"] / args.steps,
        "backward_ms": 1000 * phases["backward"] / args.steps,
        "optimizer_ms": 1000 * phases["optimizer"] / args.steps,
        "final_loss": float(out.loss),
        "parameters": sum(p.numel() for p in net.parameters()),
    }))


if __name__ == "__main__":
    main()
