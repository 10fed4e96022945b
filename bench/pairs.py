"""The model pairs `specserve bench` runs and the prompts it runs them on (the bottom of the
bench's import graph: the other modules name these, this names none of them)."""

from dataclasses import dataclass
from pathlib import Path

from engine.models import DEMO_DRAFT, DEMO_TARGET

PROMPTS = [  # code prompts ending at a token boundary the tokenizer saw in training
    "import os\n",
    "def main():\n",
    "class Config:\n",
    "    def __init__(self",
    "for i in range(",
    'if __name__ == "__main__":\n',
    "from collections import",
    "        return self.",
]
SCALED_TARGET = str(Path(DEMO_TARGET).parent.parent / "scaled-target")
BALANCED_DRAFT = str(Path(DEMO_TARGET).parent.parent / "balanced-draft")


@dataclass(frozen=True)
class Pair:
    name: str
    target: str
    target_dtype: str
    draft: str
    draft_dtype: str
    note: str


PAIRS = {
    "demo": Pair("demo", DEMO_TARGET, "float32", DEMO_DRAFT, "float32",
                 "the bundled demo pair (6.2M target, 0.95M draft)"),
    "scaled": Pair("scaled", SCALED_TARGET, "auto", DEMO_DRAFT, "float32",
                   "benchmark construct: the demo target grown function-preservingly to ~124M "
                   "parameters (same predictions, realistic forward cost), demo draft"),
    "balanced": Pair("balanced", SCALED_TARGET, "auto", BALANCED_DRAFT, "auto",
                     "benchmark construct: the scaled target, and the demo draft grown "
                     "function-preservingly until a draft token costs c = 0.15-0.25 of a target "
                     "token (same acceptance as the demo pair, the draft cost of a 1B draft for "
                     "an 8B target)"),
}
