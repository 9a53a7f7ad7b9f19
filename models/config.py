"""The base of every config section, and the model section: which policy, on which backend and device.

Each section of the run config (flows/config.py composes them) lives beside the code that uses it; bounds
live in the schema (`Field(ge=...)`, `Literal`) so the Prefect UI renders them in its form and rejects bad
values before a run starts."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Section(BaseModel):
    """A config section: unknown keys are refused (a misspelt field is an error, not a silent default)."""

    model_config = ConfigDict(extra="forbid")


class ModelConfig(Section):
    """The policy model and where it runs (models/registry.py loads it)."""

    policy: str = Field("default", description="'default' (embedded SmolLM2-135M-Instruct), 'tiny-random', a "
                        "local checkpoint folder whose tokenizer has a chat template, or a Hugging Face id")
    backend: Literal["transformers", "vllm", "scripted"] = Field(
        "transformers", description="vllm needs the gpu extra; scripted is a deterministic test policy that "
        "solves each prompt at a fixed rate, with the policy model's real token log-probs (models/scripted.py)")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:[0-9]+)?|mps)$", description="cpu, cuda, cuda:N or mps")
    dtype: Literal["auto", "bf16", "fp32"] = Field("auto", description="auto = bf16 where the device has it natively")
    batch_size: int = Field(64, ge=1, le=4096, description="sequences decoded together")
    kv_cache_gib: float = Field(1.0, gt=0, le=4096, description="transformers backend: fewer rows decode together "
                                "when their KV cache would pass this many GiB (long prompts); a prompt's samples "
                                "are always admitted together; vllm backend on CPU: the engine's KV cache size")

    @field_validator("policy")
    @classmethod
    def _policy_exists(cls, v: str) -> str:
        p = Path(v).expanduser()
        if v.startswith((".", "/", "~")) and not p.exists():
            raise ValueError(f"model path {v!r} does not exist")
        return v
