"""Build the offline demo pair: a tokenizer, a target and a draft distilled from the target.

The corpus is the Python standard library source of the running interpreter (no downloads),
so the pair is a tiny Python code-completion model. Everything is seeded; the step counts, not
wall time, define the run, so the same command on the same machine gives the same weights.

Recipe (see ../shared/MEASURED.md): byte-level BPE, a Llama-shaped target trained with small
batches, a draft first trained on the data and then distilled to the target's logits with
forward KL, which is what lifts acceptance.
"""

import json
import math
import os
import random
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

EOS = "<|endoftext|>"
SKIPPED_DIRS = {"site-packages", "test", "tests", "idle_test", "encodings", "__pycache__"}

# The pair only knows Python source, so a chat is rendered as Python comments it can continue:
# one "# <role>: <content>" line per message (any role; `~` also renders a missing content as
# ""), then "# assistant:" and a newline as the generation prompt. No special tokens.
# Tools (deployments.tools): a "# tools:" line saying how to call one, each function's JSON on
# a line of its own, before the messages; an assistant's calls follow its content on its line,
# each as <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes' format); a tool
# result is a "# tool: <content>" line like any message.
DEMO_CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '# tools: call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>\\n' }}"
    "{% for tool in tools %}"
    "{{ '# ' ~ (tool.function if tool.function is defined else tool) | tojson ~ '\\n' }}"
    "{% endfor %}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.tool_calls %}"
    "{{ '# ' ~ message['role'] ~ ': ' ~ (message['content'] or '') }}"
    "{% for call in message.tool_calls %}"
    "{% set call = call.function if call.function is defined else call %}"
    "{{ '<tool_call>{\"name\": ' ~ call.name | tojson ~ ', \"arguments\": ' ~ "
    "(call.arguments if call.arguments is string else call.arguments | tojson) ~ "
    "'}</tool_call>' }}"
    "{% endfor %}"
    "{{ '\\n' }}"
    "{% else %}"
    "{{ '# ' ~ message['role'] ~ ': ' ~ message['content'] ~ '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '# assistant:\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int


@dataclass(frozen=True)
class DemoRecipe:
    vocab_size: int = 4096
    seq_len: int = 256
    batch_size: int = 4  # 1k tokens per step: many small steps beat few large ones here
    target: ModelShape = ModelShape(6, 256, 768, 4)
    draft: ModelShape = ModelShape(2, 128, 384, 2)
    target_steps: int = 4000
    draft_steps: int = 1500
    distill_steps: int = 2500
    learning_rate: float = 2e-3
    seed: int = 0
    val_every: int = 50  # every 50th file (sorted) is held out


def stdlib_files() -> list[Path]:
    """The interpreter's standard library sources, without tests and generated tables."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        if SKIPPED_DIRS.isdisjoint(path.relative_to(root).parts[:-1]):
            files.append(path)
    return files


def read_corpus(recipe: DemoRecipe) -> tuple[list[str], list[str]]:
    """(train texts, validation texts), split by file."""
    train, val = [], []
    for i, path in enumerate(stdlib_files()):
        text = path.read_text(encoding="utf-8", errors="replace")
        (val if i % recipe.val_every == 0 else train).append(text)
    return train, val


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=None, pad_token=EOS
    )


def encode(tokenizer, texts: list[str]) -> torch.Tensor:
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for row in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(row)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def build_model(shape: ModelShape, recipe: DemoRecipe, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=recipe.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def batches(data: torch.Tensor, recipe: DemoRecipe, generator: torch.Generator):
    """Endless random windows: (inputs, labels) of shape [batch, seq_len]."""
    span = recipe.seq_len + 1
    while True:
        starts = torch.randint(0, len(data) - span, (recipe.batch_size,), generator=generator)
        windows = torch.stack([data[s : s + span] for s in starts.tolist()])
        yield windows[:, :-1], windows[:, 1:]


def lr_at(step: int, total: int, peak: float) -> float:
    warmup = max(1, total // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, data, recipe: DemoRecipe, steps: int, desc: str, teacher=None) -> None:
    """Next-token cross-entropy, or forward KL to `teacher`'s distribution when given."""
    generator = torch.Generator().manual_seed(recipe.seed + steps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=0.1)
    model.train()
    stream = batches(data, recipe, generator)
    bar = tqdm(range(steps), desc=desc, unit="step")
    for step in bar:
        inputs, labels = next(stream)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, recipe.learning_rate)
        logits = model(input_ids=inputs).logits  # [B, S, V]
        if teacher is None:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        else:
            with torch.no_grad():
                target_logp = F.log_softmax(teacher(input_ids=inputs).logits, dim=-1)
            draft_logp = F.log_softmax(logits, dim=-1)
            loss = F.kl_div(draft_logp, target_logp, log_target=True, reduction="batchmean")
            loss = loss / inputs.shape[1]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()


@torch.no_grad()
def validation_loss(model, data: torch.Tensor, recipe: DemoRecipe, max_windows: int = 64) -> float:
    span = recipe.seq_len + 1
    losses = []
    for start in range(0, min(len(data) - span, max_windows * span), span):
        window = data[start : start + span][None]
        logits = model(input_ids=window[:, :-1]).logits
        losses.append(F.cross_entropy(logits[0], window[0, 1:]).item())
    return sum(losses) / len(losses)


@torch.no_grad()
def greedy_acceptance(target, draft, data: torch.Tensor, recipe: DemoRecipe) -> float:
    """Fraction of positions where the draft's argmax equals the target's (greedy alpha)."""
    window = data[: recipe.seq_len * 8].view(8, recipe.seq_len)
    same = target(input_ids=window).logits.argmax(-1) == draft(input_ids=window).logits.argmax(-1)
    return same.float().mean().item()


def save_tokenizer(tokenizer, path: Path) -> None:
    """Save `tokenizer` with the demo chat template (transformers 5 writes chat_template.jinja)."""
    tokenizer.chat_template = DEMO_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)


def save(model, tokenizer, path: Path) -> None:
    model.to(torch.bfloat16).save_pretrained(path)  # bf16 halves the committed size
    model.to(torch.float32)
    save_tokenizer(tokenizer, path)
    for file in path.iterdir():
        os.chmod(file, 0o644)  # save_pretrained may write 0600 files


def build_demo_models(out_dir: Path, recipe: DemoRecipe = DemoRecipe()) -> dict:
    """Train and save `out_dir/target` and `out_dir/draft`; returns the training report."""
    random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)
    started = time.monotonic()
    train_texts, val_texts = read_corpus(recipe)
    tokenizer = train_tokenizer(train_texts, recipe.vocab_size)
    train_ids, val_ids = encode(tokenizer, train_texts), encode(tokenizer, val_texts)
    print(f"corpus: {len(train_texts)} train / {len(val_texts)} val files, "
          f"{len(train_ids)} / {len(val_ids)} tokens")

    target = build_model(recipe.target, recipe, tokenizer)
    train(target, train_ids, recipe, recipe.target_steps, "target")
    target_time = time.monotonic() - started
    draft = build_model(recipe.draft, recipe, tokenizer)
    train(draft, train_ids, recipe, recipe.draft_steps, "draft")
    acceptance_before = greedy_acceptance(target, draft, val_ids, recipe)
    target.requires_grad_(False)
    train(draft, train_ids, recipe, recipe.distill_steps, "distill", teacher=target)

    for name, model in (("target", target), ("draft", draft)):
        save(model, tokenizer, out_dir / name)
    report = {
        "recipe": asdict(recipe),
        "train_tokens": len(train_ids),
        "val_tokens": len(val_ids),
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "target_val_loss": validation_loss(target, val_ids, recipe),
        "draft_val_loss": validation_loss(draft, val_ids, recipe),
        "greedy_agreement_before_distill": acceptance_before,
        "greedy_agreement": greedy_acceptance(target, draft, val_ids, recipe),
        "target_train_seconds": round(target_time),
        "total_seconds": round(time.monotonic() - started),
        "torch_threads": torch.get_num_threads(),
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
