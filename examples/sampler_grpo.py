"""A minimal plain-torch GRPO loop that asks Refinery's Sampler (flows/sampler.py) for every batch.

    python examples/sampler_grpo.py --store refinery-store --run-id my-loop --steps 4 \\
        --checkpoint my-loop.pt --set model.policy=tiny-random --set select.embedder=hashing

Each step: `sampler.next_batch(B)`; G completions per prompt from the policy (sampled with a seed per step and
prompt); the project's verifier as reward; group-normalised advantages; one policy-gradient step; then
`sampler.observe(ids, rewards, completions, n_tokens)` and a checkpoint (model, optimizer, `sampler.state_dict()`
and the batches trained so far), written to a temporary name and renamed. Killed anywhere and started again
with the same command, it resumes from its checkpoint and trains on the same batches, none repeated, none
skipped (tests/test_sampler.py kills it after a round landed and before its checkpoint).

The model is `model.policy` of the config (`tiny-random` for a test, `default` for SmolLM2-135M-Instruct).
TRL and verl loops plug in the same way: ask `next_batch` where they draw a batch from their dataset, call
`observe` with the rewards their reward functions computed, and save `state_dict()` with their own checkpoint
(docs/interop.md, "The sampler").
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository, for flows/ etc.

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--checkpoint", required=True, help="the loop's checkpoint file (model, optimizer, sampler)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default=None, help="a Refinery TOML config (pool, select, utility, refine)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    a = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flows.sampler import Sampler
    from models.registry import resolve
    from tasks.core.ids import seed_of
    from tasks.core.rewards import verify

    with Sampler(a.store, a.run_id, a.config, a.set) as sampler:
        path = resolve(sampler.config.model.policy)
        tokenizer = AutoTokenizer.from_pretrained(path)
        torch.manual_seed(a.seed)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        history: list[list[str]] = []
        start = 0
        ckpt = Path(a.checkpoint)
        if ckpt.exists():
            state = torch.load(ckpt, weights_only=False)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            sampler.load_state_dict(state["sampler"])
            history, start = state["history"], state["step"]
            print(f"resumed at step {start} (sampler round {sampler.round})", flush=True)
        for step in range(start, a.steps):
            batch = sampler.next_batch(a.batch)
            ids, rewards, texts, counts = [], [], [], []
            model.train()
            optimizer.zero_grad()
            for item in batch:
                prompt = tokenizer.apply_chat_template(item["prompt"], tokenize=False, add_generation_prompt=True)
                enc = tokenizer(prompt, return_tensors="pt")
                torch.manual_seed(seed_of(f"{a.seed}:{step}:{item['prompt_id']}"))
                with torch.no_grad():
                    out = model.generate(**enc, do_sample=True, temperature=1.0, max_new_tokens=a.max_new_tokens,
                                         num_return_sequences=a.group, pad_token_id=pad)
                width = enc["input_ids"].shape[1]
                done = torch.cumsum((out[:, width:] == tokenizer.eos_token_id).int(), dim=1)
                mask = (done - (out[:, width:] == tokenizer.eos_token_id).int()) == 0  # up to and with the eos
                texts_i = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
                r = torch.tensor([verify(t, item["answer"], item["source"]).reward for t in texts_i])
                advantage = (r - r.mean()) / (r.std() + 1e-4) if a.group > 1 else r - r.mean()
                logits = model(out).logits[:, width - 1:-1].float()
                logp = torch.log_softmax(logits, -1).gather(-1, out[:, width:, None]).squeeze(-1)
                loss = -(advantage[:, None] * logp * mask).sum() / mask.sum().clamp(min=1) / len(batch)
                loss.backward()
                ids += [item["prompt_id"]] * a.group
                rewards += r.tolist()
                texts += texts_i
                counts += mask.sum(1).tolist()
            optimizer.step()
            buckets = sampler.observe(ids, rewards, texts, counts)
            history.append([item["prompt_id"] for item in batch])
            tmp = ckpt.with_name(ckpt.name + ".tmp")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "sampler": sampler.state_dict(), "history": history, "step": step + 1}, tmp)
            os.replace(tmp, ckpt)
            print(f"step {step}: {len(batch)} prompts, mean reward {sum(rewards) / len(rewards):.3f}, "
                  f"buckets {buckets}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
