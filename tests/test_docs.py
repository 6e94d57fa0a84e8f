"""Every code block of the README and of docs/ runs: each ``python`` block is executed (a block
after ``<!-- context: NAME -->`` runs in that page's namespace NAME, which the setup of NAME
below fills with the small objects the text refers to, such as a model or a batch; later blocks
of the same NAME continue it; every namespace starts with ``torch`` and ``rlfuse`` imported, as
the pages assume), each ``bash`` block's commands name what exists (Makefile
targets, modules, scripts), and their ``--help`` commands run. ``text`` blocks are formulas and
maps, not code. Every page is linked from the README. The pages are short where they are read:
the README at most 12,000 characters, no paragraph or list item over 1,000, no table cell over
500."""
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import rlfuse

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(r"(?:<!-- context: (\w+) -->\n)?```(\w*)\n(.*?)```", re.S)


def blocks(page: Path):
    """(language, context or None, code, line) of every fenced block of ``page``."""
    text = page.read_text()
    for m in BLOCK.finditer(text):
        yield m.group(2), m.group(1), m.group(3), text[:m.start()].count("\n") + 1


ALL = [(page, *block) for page in PAGES for block in blocks(page)]


def test_every_block_has_a_language_and_every_page_is_linked():
    for page, language, _, _, line in ALL:
        assert language in ("python", "bash", "text"), f"{page.name}:{line}: ```{language}"
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, page.name


# --------------------------------------------------------------------------------------------
# The contexts: what the text of a page refers to, small
# --------------------------------------------------------------------------------------------

V, H = 50, 16


class Output(NamedTuple):
    logits: torch.Tensor


class TinyLM(torch.nn.Module):
    """``model(input_ids).logits``: an embedding and a head."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(V, H), torch.nn.Linear(H, V)

    def forward(self, input_ids):
        return Output(self.head(torch.tanh(self.embed(input_ids))))


def _batch(B=4, S=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = torch.ones(B, S - 1, dtype=torch.bool)
    mask[:, :2] = False                                         # the prompt
    return dict(input_ids=ids, ids=ids, response_mask=torch.cat([mask[:, :1], mask], 1),
                mask=mask, rewards=(torch.rand(B, generator=g) > 0.5).float(),
                old_logprobs=-2 * torch.rand(B, S - 1, generator=g),
                advantages=torch.randn(B, generator=g))


def context_quickstart(tmp_path):
    torch.manual_seed(0)
    return dict(model=TinyLM(), **_batch())


def context_model(tmp_path):
    return context_quickstart(tmp_path)


def context_tensors(tmp_path):
    return {}


def context_batch(tmp_path):
    d = _batch()
    d["logits"] = torch.randn(4, 6, V, requires_grad=True)
    d["teacher_logprobs"] = d["old_logprobs"] - torch.rand(4, 6)
    return d


def context_training(tmp_path, batch=4):
    torch.manual_seed(0)
    model, reference_model = TinyLM(), TinyLM()
    d = _batch(B=batch)
    with torch.no_grad():
        ref = rlfuse.policy_logprobs(rlfuse.Logits(reference_model(d["ids"]).logits,
                                                   d["ids"][:, 1:]))
    return dict(model=model, reference_model=reference_model, ref_logprobs=ref,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1), refresh_every=2,
                global_token_count=float(d["mask"].sum()), **d)


def context_distillation(tmp_path):
    d = context_training(tmp_path, batch=8)
    d.update(old_lp=d["ref_logprobs"], teacher_lp=d["ref_logprobs"] - 0.3,
             micro_batches=[slice(0, 4), slice(4, 8)])       # whole groups of 4
    return d


def context_head(tmp_path):
    g = torch.Generator().manual_seed(1)
    B, P, T = 4, 3, 5
    return dict(hidden=torch.randn(B, P + T, H, generator=g, requires_grad=True),
                lm_head=torch.nn.Linear(H, V, bias=False), P=P,
                ids=torch.randint(0, V, (B, P + T), generator=g),
                old_logprobs=-2 * torch.rand(B, T, generator=g),
                advantages=torch.randn(B, generator=g), mask=torch.ones(B, T, dtype=torch.bool),
                global_tokens=float(B * T))


def context_packed(tmp_path):
    g = torch.Generator().manual_seed(2)
    return dict(logits=torch.randn(12, V, generator=g, requires_grad=True),
                targets=torch.randint(0, V, (12,), generator=g),
                old_logprobs=-2 * torch.rand(2, 4, generator=g),
                advantages=torch.randn(2, generator=g),
                mask=torch.tensor([[True] * 4, [True] * 3 + [False]]))


def context_trl(tmp_path):
    from test_trl import config, dataset, model, reward, tokenizer

    settings = config(tmp_path, max_steps=1)
    settings.pop("beta")
    return dict(model=model(), reward=reward, data=dataset(), tokenizer=tokenizer(),
                settings=settings)


def context_trl_distill(tmp_path):
    from test_trl import dataset, tokenizer
    from test_trl_distill import config, student, teacher

    return dict(student=student(), teacher=teacher(), data=dataset(), tokenizer=tokenizer(),
                settings=config(tmp_path, max_steps=1))


def context_verl(tmp_path):
    from test_verl import batch, config

    old, lp, adv, mask, _ = batch(0, torch.device("cpu"))
    return dict(old_log_prob=old, log_prob=lp.clone().requires_grad_(), advantages=adv,
                response_mask=mask, actor_config=config())


def context_megatron(tmp_path):
    """Megatron's tensors on one process (no parallel_state: the whole head, no data- or
    context-parallel group)."""
    from types import SimpleNamespace

    from rlfuse.integrations import megatron as rlfuse_megatron

    g = torch.Generator().manual_seed(3)
    s, b = 6, 2
    weight = torch.randn(V, H, generator=g)
    hidden = torch.randn(s, b, H, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (b, s), generator=g)
    return dict(hidden=hidden, weight=weight, dp_group=None, cp_group=None,
                head=rlfuse_megatron.output_head(hidden, weight, labels),
                model=SimpleNamespace(output_layer=SimpleNamespace(weight=weight)),
                labels=labels,
                config=SimpleNamespace(sequence_parallel=False),
                old_logprobs=-2 * torch.rand(b, s, generator=g),
                advantages=torch.randn(b, generator=g),
                loss_mask=torch.ones(b, s, dtype=torch.bool))


@pytest.mark.parametrize("page, context", sorted(
    {(page, context) for page, language, context, _, _ in ALL if language == "python"},
    key=lambda pc: (pc[0].name, pc[1] or "")), ids=lambda x: getattr(x, "name", x))
def test_python_blocks_run(page, context, tmp_path, monkeypatch):
    """The page's blocks of one context, in order, in one namespace (a block without a
    context: in a fresh one)."""
    monkeypatch.chdir(tmp_path)
    selected = [(code, line) for p, language, c, code, line in ALL
                if p == page and language == "python" and c == context]
    setup = globals()[f"context_{context}"] if context else (lambda path: {})
    namespace = dict(torch=torch, rlfuse=rlfuse, **setup(tmp_path))
    for code, line in selected:
        if context is None:
            namespace = dict(torch=torch, rlfuse=rlfuse)
        try:
            exec(compile(code, f"{page.name}:{line}", "exec"), namespace)
        except Exception as e:   # noqa: BLE001  (the page and line of the failing block)
            raise AssertionError(f"{page.name}:{line}: {type(e).__name__}: {e}") from e


# --------------------------------------------------------------------------------------------
# Shell commands
# --------------------------------------------------------------------------------------------

def _commands():
    for page, language, _, code, line in ALL:
        if language != "bash":
            continue
        for text in code.splitlines():
            text = text.split("  #")[0].split(" # ")[0].strip()
            if text and not text.startswith("#"):
                yield page, line, text


MAKE_TARGETS = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def _module_exists(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@pytest.mark.parametrize("page, line, command", list(_commands()),
                         ids=[f"{p.name}:{n}" for p, n, _ in _commands()])
def test_shell_commands_name_what_exists(page, line, command):
    words = [w for w in shlex.split(command) if not re.match(r"^[A-Z_]+=", w)]
    program, args = words[0], words[1:]
    if program == "make":
        assert set(args) <= MAKE_TARGETS, command
    elif program in ("python", "python3", "torchrun") and "-m" in args:
        module = args[args.index("-m") + 1]
        assert _module_exists(module), command
        if "--help" in args:
            env = dict(os.environ, TRITON_INTERPRET="1")
            proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0 and "usage" in proc.stdout, proc.stderr[-2000:]
    elif program == "bash":
        assert (ROOT / args[0]).is_file(), command
    elif program in ("pip", "pytest"):
        assert program == "pip" or all((ROOT / a).exists() for a in args if "/" in a), command
    else:
        pytest.fail(f"{page.name}:{line}: a command of an unknown program: {command}")


# --------------------------------------------------------------------------------------------
# Short where read
# --------------------------------------------------------------------------------------------

README_CHARS, PARAGRAPH_CHARS, CELL_CHARS = 12_000, 1_000, 500
FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```", re.S | re.M)
MARKER = re.compile(r"^<!--.*-->[ \t]*$", re.M)          # a line that is a comment alone
LIST_ITEM = re.compile(r"^[ \t]*(?:[-*+]|\d+\.)[ \t]", re.M)


def _paragraphs_and_cells(text: str):
    """("paragraph" or "cell", text) of a page outside its fenced blocks: a block between blank
    lines whose every line starts with ``|`` is a table, each of its cells one piece; any other
    block is cut where a list item starts, each item (and the text before the first) one
    paragraph."""
    text = MARKER.sub("", FENCE.sub("", text))
    for block in re.split(r"\n[ \t]*\n", text):
        lines = [line.strip() for line in block.splitlines() if line.strip()]
        if lines and all(line.startswith("|") for line in lines):
            for line in lines:
                for cell in re.split(r"(?<!\\)\|", line.strip("|")):
                    yield "cell", cell.strip()
            continue
        starts = [m.start() for m in LIST_ITEM.finditer(block)]
        for begin, end in zip([0] + starts, starts + [len(block)]):
            if block[begin:end].strip():
                yield "paragraph", block[begin:end].strip()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_are_short_where_read(page):
    text = page.read_text()
    if page == ROOT / "README.md":
        assert len(text) <= README_CHARS, f"README.md: {len(text)} characters"
    limit = {"paragraph": PARAGRAPH_CHARS, "cell": CELL_CHARS}
    long = [f"a {kind} of {len(piece)} characters: {piece[:80]!r}"
            for kind, piece in _paragraphs_and_cells(text) if len(piece) > limit[kind]]
    assert not long, long
