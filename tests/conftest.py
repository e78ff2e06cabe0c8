"""Shared test fixtures: paths to the models in ../shared and tiny random models of each family."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SHARED_MODELS = REPO.parent / "shared" / "models"
STORIES = SHARED_MODELS / "stories260k"
LLAMA2XS = SHARED_MODELS / "llama2xs"
PYCODER = REPO / "models" / "pycoder-25m"

# Twenty story openings: greedy continuations of these do not degenerate on stories260k.
STORY_PROMPTS = [
    "Once upon a time",
    "One day, a little girl named Lily",
    "Tom and his dog went to the park",
    "The sun was shining and the birds",
    "There was a big red ball",
    "Mom said it was time for bed, but",
    "Sara had a new toy car",
    "In the forest there lived a small rabbit",
    "The boy wanted to eat the cake",
    "Once there was a happy cat named Tim",
    "Ben and Mia liked to play in the garden",
    "It was a cold and rainy day",
    "The little bird could not fly",
    "Lucy found a shiny stone",
    "Dad took Max to the beach",
    "The old man had a magic hat",
    "Anna was sad because her doll was broken",
    "A friendly dragon lived on a hill",
    "Timmy did not want to share his blocks",
    "The princess looked out of the window",
]


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    return STORIES


def tiny_config(family: str, **overrides):
    """A randomly initialisable config of ``family`` small enough for exact tests."""
    from transformers import AutoConfig

    base = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    extra = {
        "llama": {},
        "mistral": {"sliding_window": 8},
        "qwen2": {"use_sliding_window": False},
        "qwen3": {"head_dim": 16},
    }[family]
    base.update(extra)
    base.update(overrides)
    return AutoConfig.for_model(family, **base)


def tiny_model(family: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation="sdpa")
    return model.float().eval()


@pytest.fixture(scope="session")
def stories_target():
    from specula.target import Target

    return Target.load(STORIES, dtype="float32")


@pytest.fixture(scope="session")
def stories_samples(stories_target):
    """Greedy self-distilled continuations of the story prompts with the target's final features."""
    import specula
    from specula.target import FeatureRequest

    speculator = specula.load(STORIES, method="vanilla", dtype="float32")
    samples = []
    for prompt in STORY_PROMPTS:
        prompt_ids = speculator.encode(prompt)
        result = speculator.generate(prompt_ids, max_new_tokens=60)
        ids = torch.cat([prompt_ids, torch.tensor(result.token_ids)])
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(prompt_ids):] = True
        hidden = stories_target.prefill(ids, FeatureRequest(final_hidden=True)).hidden
        samples.append({"input_ids": ids, "loss_mask": mask, "hidden": hidden})
    return samples


@pytest.fixture(scope="module")
def single_thread():
    """Run a module's tests on one intra-op thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def no_machine_profile(tmp_path_factory):
    """Keep a hardware profile left on this machine by `specula calibrate` from changing test defaults."""
    import os

    previous = os.environ.get("SPECULA_CACHE_DIR")
    os.environ["SPECULA_CACHE_DIR"] = str(tmp_path_factory.mktemp("specula-cache"))
    yield
    if previous is None:
        os.environ.pop("SPECULA_CACHE_DIR", None)
    else:
        os.environ["SPECULA_CACHE_DIR"] = previous
