"""Story-opening prompts for training draft heads on stories260k (a TinyStories model) by self-distillation.

Combines names, places and things into one-sentence openings in TinyStories' style. None of
them comes from an evaluation set; the target writes every continuation itself.

    .venv/bin/python scripts/build_story_prompts.py --count 1200 --out runs/story_prompts.jsonl
"""

import argparse
import itertools
import json
import random

NAMES = ["Lily", "Tom", "Sara", "Ben", "Mia", "Max", "Anna", "Tim", "Lucy", "Jack", "Emma", "Sam", "Zoe",
         "Leo", "Kate", "Bob", "Amy", "Joe", "Sue", "Dan"]
PLACES = ["park", "forest", "beach", "garden", "farm", "zoo", "school", "lake", "hill", "town", "shop",
          "river", "castle", "playground", "kitchen"]
THINGS = ["ball", "kite", "red hat", "little dog", "big box", "shiny stone", "toy car", "blue bird",
          "teddy bear", "balloon"]
OPENINGS = ["Once upon a time, {n} went to the {p} with a {t}.", "One day, {n} found a {t} at the {p}.",
            "{n} loved to play at the {p}. One morning, {n} saw a {t}.",
            "There was a {t} in the {p}, and {n} wanted it."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    combos = list(itertools.product(OPENINGS, NAMES, PLACES, THINGS))
    random.Random(args.seed).shuffle(combos)
    with open(args.out, "w") as out:
        for template, name, place, thing in combos[: args.count]:
            out.write(json.dumps({"prompt": template.format(n=name, p=place, t=thing)}) + "\n")


if __name__ == "__main__":
    main()
