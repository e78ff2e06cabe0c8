"""What the target is asked to write for its own training data: conversation jobs, deterministic under a seed.

A `Job` is one or more `Conversation`s the target plays out in one KV sequence each (`specula.training.capture`);
every conversation becomes one training sample. A turn is either fixed text (a system prompt, a seed prompt, a
task wrapped around an earlier turn's text) or written by the target: assistant turns are the answers a head
learns to draft (greedy or sampled), user turns are Magpie follow-ups (the target, given the conversation up to
a user prefix, writes what the user says next, at temperature 1).

Job kinds (`PromptMix` weights; a kind whose seed file is missing gives its share to ``magpie``):
- ``magpie``: the target writes the opening user message too (Magpie), then answers; 1-3 rounds;
- ``gsm8k``, ``alpaca``: a GSM8K *train* question or an Alpaca seed task (instruction and input) opens; maybe a
  Magpie follow-up round;
- ``long``: a request for a long, detailed answer (an essay, a guide, a story) from built-in topics;
- ``document``: the target writes a document (an article, a report, a letter... on a built-in topic) and
  then, in a second conversation that quotes it as the user's text, summarizes, rewrites, lists or answers a
  question the target itself asked about it (the shape of Spec-Bench's summarization and RAG categories,
  none of their data).
A third of jobs carry one of the built-in system prompts. Every text here is original or from the seed files
given; nothing comes from MT-bench, Spec-Bench or HumanEval (tests check the texts against them).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from pathlib import Path

from specula.errors import SpeculaError
from specula.files.jsonl import json_lines

Ref = tuple[int, int]  # (conversation, turn) of an earlier conversation of the same job, quoted by its text


@dataclass(frozen=True)
class Turn:
    """One message: ``parts`` (text pieces and `Ref`s, joined) when fixed; empty when the target writes it."""

    role: str  # system | user | assistant
    parts: tuple[str | Ref, ...] = ()
    temperature: float = 1.0
    max_new_tokens: int = 0

    @property
    def generated(self) -> bool:
        return not self.parts


@dataclass(frozen=True)
class Conversation:
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Job:
    index: int
    kind: str
    seed: int  # of the target's sampling in this job (per conversation: seed + conversation index)
    temperature: float  # of its assistant turns
    conversations: tuple[Conversation, ...]


# The longest ordinary answer by default, and how much longer a long-answer job's and a document job's answers may
# be (1,024 and 768 tokens by default).
ANSWER_TOKENS = 640
LONG_ANSWER_SCALE = 1.6
DOCUMENT_ANSWER_SCALE = 1.2


@dataclass(frozen=True)
class PromptMix:
    """Which jobs are drawn, how often, and how long their turns may be."""

    seed: int = 0
    temperatures: tuple[float, ...] = (0.0, 1.0)  # assistant turns: each job draws one
    weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    answer_tokens: int = ANSWER_TOKENS
    long_tokens: int = round(ANSWER_TOKENS * LONG_ANSWER_SCALE)
    document_tokens: int = round(ANSWER_TOKENS * DOCUMENT_ANSWER_SCALE)
    user_tokens: int = 128
    system_share: float = 0.35
    gsm8k: Path | None = None  # JSONL of {"prompt": ...} (GSM8K train questions)
    alpaca: Path | None = None  # JSONL of Alpaca seed tasks ({"instruction", "instances": [{"input"}]})
    chat: bool = True  # False for a model without a chat template: seed prompts continued as plain text

    def __post_init__(self) -> None:
        unknown = set(self.weights) - set(DEFAULT_WEIGHTS)
        if unknown or any(w < 0 for w in self.weights.values()) or sum(self.weights.values()) <= 0:
            raise SpeculaError(f"job weights must be >= 0 over {', '.join(DEFAULT_WEIGHTS)}, got {self.weights}")
        if not self.temperatures or any(not 0 <= t < float("inf") for t in self.temperatures):
            raise SpeculaError(f"answer temperatures must be finite numbers >= 0, got {self.temperatures}")
        for name in ("answer_tokens", "long_tokens", "document_tokens", "user_tokens"):
            if getattr(self, name) < 1:
                raise SpeculaError(f"{name} must be >= 1")

    def describe(self) -> dict:
        """What the jobs depend on, for a run's fingerprint: settings and the seed files' contents."""
        files = {name: None if path is None else hashlib.sha256(Path(path).read_bytes()).hexdigest()[:20]
                 for name, path in (("gsm8k", self.gsm8k), ("alpaca", self.alpaca))}
        return {"seed": self.seed, "temperatures": list(self.temperatures), "weights": self.weights,
                "answer_tokens": self.answer_tokens, "long_tokens": self.long_tokens,
                "document_tokens": self.document_tokens, "user_tokens": self.user_tokens,
                "system_share": self.system_share, "chat": self.chat, "files": files, "version": JOBS_VERSION}


JOBS_VERSION = 1
DEFAULT_WEIGHTS = {"magpie": 0.30, "gsm8k": 0.15, "alpaca": 0.05, "long": 0.15, "document": 0.35}

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a friendly assistant. Keep your answers clear and well organised.",
    "Answer as briefly as you can while still being correct.",
    "You are a patient tutor. Explain your reasoning step by step.",
    "You are an expert writer. Use vivid, precise language.",
    "Respond in a formal, professional tone.",
    "You are a careful assistant that double-checks facts before answering.",
    "You help students with homework. Show your work.",
    "You are a creative storyteller.",
    "Reply in plain language a twelve-year-old can follow.",
    "You are a concise technical assistant for software developers.",
    "Always structure your answer with short headings and bullet points.",
)
TOPICS = (
    "the water cycle", "honeybees", "the history of the bicycle", "volcanoes", "how vaccines work",
    "urban gardening", "the printing press", "coral reefs", "saving money on groceries", "the Moon landing",
    "solar panels", "sleep and memory", "the Silk Road", "learning a second language", "recycling plastic",
    "the human heart", "chess strategy", "rainforests", "electric cars", "the invention of paper",
    "public libraries", "earthquakes", "healthy breakfasts", "the Roman aqueducts", "time management",
    "migratory birds", "3D printing", "the history of jazz", "composting", "black holes", "first aid basics",
    "the immune system", "wind energy", "ancient Egypt", "remote work", "photosynthesis", "the stock market",
    "writing a resume", "deserts", "the telephone", "dog training", "climate and weather", "bread baking",
    "the Olympic Games", "cybersecurity for beginners", "tides and the ocean", "the Renaissance", "mushrooms",
    "public transport", "video game design", "antibiotics", "the metric system", "camping safety",
    "how bridges stand up", "tea around the world", "the human brain", "glaciers", "starting a small business",
    "the history of maps", "robots in factories", "octopuses", "running a marathon", "the periodic table",
)
GENRES = (
    "a news article", "a blog post", "an encyclopedia entry", "a short report", "a letter to a friend",
    "a product description", "a short story", "a speech", "a how-to guide", "a museum exhibit text",
    "a school essay", "a newsletter item", "a travel diary entry", "a FAQ page", "a meeting summary memo",
)
LONG_REQUESTS = (
    "Write a detailed essay about {topic}. Cover its background, how it works, and why it matters, "
    "in several paragraphs.",
    "Explain {topic} in depth, step by step, with examples.",
    "Write a long, complete beginner's guide to {topic}, with sections and practical tips.",
    "Write a long story in which a character's life is changed by {topic}.",
    "Give a thorough overview of {topic}: its history, the main ideas, common misconceptions and open "
    "questions.",
)
DOCUMENT_REQUESTS = ("Write {genre} about {topic}.", "Please write {genre} on {topic}, about four paragraphs long.")
DOCUMENT_TASKS = (  # the quoted document is the `Ref` between the pieces
    ("Summarize the following text in a few sentences.\n\n", ""),
    ("", "\n\nWrite a short summary of the text above."),
    ("", "\n\nRewrite the text above in simpler words for a young reader."),
    ("", "\n\nList the main points of this text as bullet points."),
    ("Here is a text:\n\n", "\n\nSuggest a title for it and explain your choice in one sentence."),
    ("", "\n\nRewrite this text in a more formal tone."),
    ("Read this text:\n\n", "\n\nWhat is its main idea, and what details support it?"),
)
QUESTION_TASK = ("Use the text below to answer the question.\n\nText:\n", "\n\nQuestion: ", "")


def read_seed_prompts(path: str | Path | None, kind: str) -> list[str]:
    """Prompts of a seed file: ``{"prompt"}`` lines (GSM8K) or Alpaca seed tasks (instruction, first input)."""
    if path is None:
        return []
    file = Path(path)
    if not file.is_file():
        raise SpeculaError(f"{kind} seed file not found: {path}")
    prompts = []
    for _, where, obj in json_lines(file.read_text(encoding="utf-8").splitlines(), lambda n: f"{path}, line {n}"):
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            prompts.append(obj["prompt"].strip())
        elif isinstance(obj, dict) and isinstance(obj.get("instruction"), str):
            instances = obj.get("instances") or [{}]
            extra = (instances[0].get("input") or "").strip() if isinstance(instances[0], dict) else ""
            prompts.append(obj["instruction"].strip() + (f"\n\n{extra}" if extra else ""))
        else:
            raise SpeculaError(f"{where}: expected {{'prompt': ...}} or an Alpaca seed task")
    if not prompts:
        raise SpeculaError(f"{kind} seed file {path} holds no prompts")
    return prompts


class JobMaker:
    """`job(i)`: the i-th job of a mix, a pure function of (mix, i) — a resumed run asks for the same jobs."""

    def __init__(self, mix: PromptMix):
        self.mix = mix
        self.seeds = {"gsm8k": read_seed_prompts(mix.gsm8k, "GSM8K"), "alpaca": read_seed_prompts(mix.alpaca, "Alpaca")}
        weights = dict(mix.weights)
        for kind in ("gsm8k", "alpaca"):
            if not self.seeds[kind]:
                weights["magpie"] = weights.get("magpie", 0.0) + weights.pop(kind, 0.0)
        if not mix.chat:  # without a chat template only seed prompts make sense: continued as plain text
            weights = {kind: w for kind, w in weights.items() if kind in ("gsm8k", "alpaca") and w > 0}
            if not weights:
                raise SpeculaError("a model without a chat template needs seed prompts (GSM8K or Alpaca files)")
        self.kinds = sorted(k for k, w in weights.items() if w > 0)
        self.weights = [weights[k] for k in self.kinds]

    def job(self, index: int) -> Job:
        digest = hashlib.sha256(f"{self.mix.seed}:{index}".encode()).digest()
        rng = random.Random(int.from_bytes(digest[:8], "little"))
        kind = rng.choices(self.kinds, self.weights)[0]
        temperature = rng.choice(self.mix.temperatures)
        seed = int.from_bytes(digest[8:16], "little") % 2**62
        system = (Turn("system", (rng.choice(SYSTEM_PROMPTS),)),) if self.mix.chat and \
            rng.random() < self.mix.system_share else ()
        conversations = getattr(self, f"_{kind}")(rng, temperature, system)
        return Job(index, kind, seed, temperature, conversations)

    def _answer(self, temperature: float, tokens: int | None = None) -> Turn:
        return Turn("assistant", (), temperature, tokens or self.mix.answer_tokens)

    def _follow_up(self) -> Turn:
        return Turn("user", (), 1.0, self.mix.user_tokens)

    def _rounds(self, rng: random.Random, temperature: float, extra: int) -> tuple[Turn, ...]:
        turns: tuple[Turn, ...] = ()
        for _ in range(extra):
            turns += (self._follow_up(), self._answer(temperature))
        return turns

    def _magpie(self, rng, temperature, system):
        rounds = rng.choices((1, 2, 3), (0.4, 0.4, 0.2))[0]
        opening = (self._follow_up(), self._answer(temperature))
        return (Conversation(system + opening + self._rounds(rng, temperature, rounds - 1)),)

    def _seeded(self, kind, rng, temperature, system):
        prompt = rng.choice(self.seeds[kind])
        if not self.mix.chat:
            return (Conversation((Turn("user", (prompt,)), self._answer(temperature))),)
        extra = 1 if rng.random() < 0.3 else 0
        turns = system + (Turn("user", (prompt,)), self._answer(temperature)) + self._rounds(rng, temperature, extra)
        return (Conversation(turns),)

    def _gsm8k(self, rng, temperature, system):
        return self._seeded("gsm8k", rng, temperature, system)

    def _alpaca(self, rng, temperature, system):
        return self._seeded("alpaca", rng, temperature, system)

    def _long(self, rng, temperature, system):
        request = rng.choice(LONG_REQUESTS).format(topic=rng.choice(TOPICS))
        return (Conversation(system + (Turn("user", (request,)), self._answer(temperature, self.mix.long_tokens))),)

    def _document(self, rng, temperature, system):
        request = rng.choice(DOCUMENT_REQUESTS).format(genre=rng.choice(GENRES), topic=rng.choice(TOPICS))
        document: Ref = (0, len(system) + 1)
        if rng.random() < 0.4:
            # The target asks about its own document (Magpie), answers in context, and answers again with the
            # document quoted in a fresh conversation: reading comprehension over a text it did not write there.
            first = system + (Turn("user", (request,)), self._answer(temperature, self.mix.document_tokens),
                              self._follow_up(), self._answer(temperature))
            before, middle, after = QUESTION_TASK
            question: Ref = (0, len(system) + 2)
            task = Turn("user", tuple(p for p in (before, document, middle, question, after) if p != ""))
        else:
            first = system + (Turn("user", (request,)), self._answer(temperature, self.mix.document_tokens))
            before, after = rng.choice(DOCUMENT_TASKS)
            task = Turn("user", tuple(p for p in (before, document, after) if p != ""))
        second_system = (Turn("system", (rng.choice(SYSTEM_PROMPTS),)),) if rng.random() < self.mix.system_share \
            else ()
        return (Conversation(first), Conversation(second_system + (task, self._answer(temperature))))


def fixed_texts(job: Job) -> list[str]:
    """The job's fixed message texts (the parts that are not references), for checks against evaluation sets."""
    return [part for conversation in job.conversations for turn in conversation.turns for part in turn.parts
            if isinstance(part, str)]


def normalise(text: str) -> str:
    return " ".join(text.lower().split())


def evaluation_overlap(texts: list[str], questions: list[str], min_chars: int = 24) -> list[tuple[str, str]]:
    """(text, question) pairs where a text equals or contains an evaluation question (case and spacing ignored).

    Questions shorter than ``min_chars`` (after normalising) are too generic to mean contamination.
    """
    wanted = sorted({q for q in map(normalise, questions) if len(q) >= min_chars}, key=len)
    found = []
    for text in texts:
        flat = normalise(text)
        found.extend((text, q) for q in wanted if len(q) <= len(flat) and q in flat)
    return found
