"""The update's logprob pieces one by one, on CPU, printed as JSON: what each candidate change to
`lora_ppo.logprobs.token_logprobs` (the LM head and the per-token logprob and entropy, forward and
backward, chunked and checkpointed as the update runs them) would save per policy micro-batch.

- `strided`: the response positions' hidden states as the update slices them (a strided view),
  straight into the LM head: what lora_ppo did before 2026-11-26;
- `contiguous`: the same, copied contiguous first (what `Backbone.token_logits` does now);
- `no_entropy_grad`: as `contiguous`, with the entropy outside autograd (it enters the loss only
  times `ppo.entropy_coef`, 0 by default);
- `compiled`: as `contiguous`, with everything after the LM head (temperature, logsumexp, the
  target's logit, the entropy) one `torch.compile`d function; its compile time is reported apart.

Shapes: the update micro-batches of `bench/vs_trl.py` (8 rows x 32 response tokens, hidden 512)
and of the quickstart (8 x 20, hidden 576), both with SmolLM2's 49,152-token vocabulary.

    python bench/update_pieces.py [--repeats 10]      # about 2 minutes on 2 cores; run alone
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"vs_trl": {"rows": 8, "prompt": 16, "response": 32, "hidden": 512},
          "quickstart": {"rows": 8, "prompt": 24, "response": 20, "hidden": 576}}
VOCAB = 49152


def main() -> None:
    import torch

    from lora_ppo import logprobs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    def after_head(logits, targets, temperature):
        logits = logits.float() / temperature
        log_norm = torch.logsumexp(logits, dim=-1)
        target_logits = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = log_norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        return target_logits - log_norm, entropy

    compiled_after_head = torch.compile(after_head, dynamic=False)
    chunk_logprobs = logprobs._chunk_logprobs  # each variant replaces it for its run
    result: dict = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": torch.get_num_threads()}
    for name, shape in SHAPES.items():
        torch.manual_seed(0)
        head = torch.nn.Linear(shape["hidden"], VOCAB, bias=False).requires_grad_(False)
        total = shape["prompt"] + shape["response"]
        states = torch.randn(shape["rows"], total, shape["hidden"])
        targets = torch.randint(VOCAB, (shape["rows"], shape["response"]))
        contiguous_head = lambda h: head(h.contiguous())  # noqa: E731

        def no_entropy_grad(lm_head, hidden, t, temperature):
            lp, ent = chunk_logprobs(lm_head, hidden, t, temperature)
            return lp, ent.detach()

        def compiled(lm_head, hidden, t, temperature):
            return compiled_after_head(lm_head(hidden), t, temperature)

        variants = {"strided": (head, chunk_logprobs), "contiguous": (contiguous_head, chunk_logprobs),
                    "no_entropy_grad": (contiguous_head, no_entropy_grad), "compiled": (contiguous_head, compiled)}
        row: dict = {**shape, "vocab": VOCAB}
        reference = None
        for variant, (lm_head, chunk_fn) in variants.items():
            logprobs._chunk_logprobs = chunk_fn

            def once():
                hidden = states.clone().requires_grad_(True)
                predicting = hidden[:, shape["prompt"] - 1: -1]
                lp, ent = logprobs.token_logprobs(lm_head, predicting, targets, temperature=0.7)
                (lp.sum() - 0.0 * ent.sum()).backward()
                return lp.detach(), hidden.grad

            try:
                t0 = time.perf_counter()
                lp, grad = once()  # the first call: compiling, for `compiled`
                first = time.perf_counter() - t0
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    once()
                    times.append(time.perf_counter() - t0)
            finally:
                logprobs._chunk_logprobs = chunk_logprobs
            reference = reference or (lp, grad)
            row[variant] = {"median_s": round(statistics.median(times), 4), "first_call_s": round(first, 2),
                            "max_logprob_diff": float((lp - reference[0]).abs().max()),
                            "max_grad_diff": float((grad - reference[1]).abs().max())}
        result[name] = row
        print(json.dumps({name: row}), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
