"""Logits of a model exported with `ckptctl export RUN STEP --format hf-olmoe --out DIR`, as
Hugging Face transformers' OlmoeForCausalLM computes them.

    python3 ops/interop/hf_olmoe_logits.py --model DIR --tokens TOKENS.json --out LOGITS.f32

TOKENS.json holds {"batch": B, "tokens": [...]} (B sequences of equal length). LOGITS.f32 gets
the [B * seq, vocab] logits as little-endian float32. Exits 3 with "skipped: ..." when torch
or transformers is not installed (`ops/setup.sh interop` installs them).
"""

import argparse
import json
import sys


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    try:
        import torch
        from transformers import OlmoeForCausalLM
    except ImportError as missing:
        print(f"skipped: {missing} (ops/setup.sh interop installs torch and transformers)",
              file=sys.stderr)
        sys.exit(3)

    with open(args.tokens) as f:
        request = json.load(f)
    batch = request["batch"]
    tokens = torch.tensor(request["tokens"], dtype=torch.long).reshape(batch, -1)
    model = OlmoeForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                             attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    logits = logits.reshape(-1, logits.shape[-1]).to(torch.float32).contiguous()
    with open(args.out, "wb") as f:
        f.write(logits.numpy().astype("<f4").tobytes())
    print(json.dumps({"rows": logits.shape[0], "vocab": logits.shape[1],
                      "transformers": __import__("transformers").__version__}))


if __name__ == "__main__":
    main()
