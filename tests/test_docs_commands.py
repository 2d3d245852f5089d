"""What README.md and docs/*.md tell a user to type exists: every `nonstop ...` line they show (code
blocks and inline code) names a real subcommand and only flags that subcommand accepts, every
`--flag` named in the prose is a flag of some subcommand, every policy key they name is in the
policy's schema, every policy they spell out loads, and the commands that run here in a moment
exit 0. Also: no sentence defers to a release to come ("today", "for now", "the next release"):
the docs say what the code does now."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import typing
from functools import lru_cache
from pathlib import Path

import pytest
from pydantic import BaseModel

from conftest import ROOT, nonstop_cmd
from nonstop import inject, policy
from nonstop.cli import build_parser
from nonstop.errors import UsageError

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
IDS = [str(p.relative_to(ROOT)) for p in DOCS]

# a fenced block (``` or ```sh, also indented inside a list item) and an inline code span (which
# may go on over a line break, never over a blank line)
FENCE = re.compile(r"^[ \t]*```([\w-]*)[ \t]*\n(.*?)^[ \t]*```", re.S | re.M)
SPAN = re.compile(r"`((?:[^`\n]|\n(?![ \t]*\n))+)`")
SHELL_BLOCKS = ("", "sh", "bash", "shell", "console")
# "nonstop run ...", "python -m nonstop bench ...": not "nonstop.wrap", "nonstop:", "nonstop-runs/",
# nor a diagram's "(nonstop run)"
COMMAND = re.compile(r"(?<![\w./(-])nonstop[ \t\n]+(?=[a-z-])")
SHELL_OPERATORS = {">", ">>", "<", "|", "||", "&&", ";", "&", "2>", "2>&1"}
# inline code that is another tool's command line: its flags are that tool's
OTHER_TOOLS = {"torchrun", "sbatch", "srun", "scancel", "kubectl", "python", "python3", "pip",
               "etcd", "etcdctl", "openssl", "bash", "make", "py-spy", "#SBATCH"}
# flags of other tools that the docs name on their own, in the prose about those tools
FOREIGN_FLAGS = {
    "--local-addr": "torchrun",
    "--rdzv-conf": "torchrun",
    "--no-kill": "sbatch and srun",
    "--exclusive": "sbatch",
    "--gres": "sbatch",
    "--initial-cluster": "etcd",
    "--mode": "the benchmarks' job script (bench/nonstop_bench/job.py)",
}
# dotted names that are not the policy's: the summary's (docs/events.md, "Summary")
NOT_POLICY = {"state.snapshot.every"}
POLICY_KEY = re.compile(r"(?<![\w./$-])((?:recover|detect|state|hosts|rules|hooks|timeouts|levels"
                        r"|scale_in)(?:\.[a-z_]\w*|\.\d+|\[\])+)(?![\w(])")
SHORT_KEYS = {"timeouts": ("recover", "timeouts"), "levels": ("recover", "levels"),
              "scale_in": ("recover", "levels", "scale_in")}
FILE_SUFFIXES = {"py", "md", "yaml", "yml", "json", "jsonl", "log", "png", "sh"}
# a sentence that speaks of a release to come, or of "today": stale as soon as the code moves on
DEFERRED = re.compile(r"\b(?:(?:this|the next|next|a later|later|a future|future|an upcoming"
                      r"|coming) releases?|today(?:'s)?|for now)\b", re.I)


# -- reading the docs ------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _text(doc: Path) -> str:
    return doc.read_text()


def _blocks(doc: Path) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(_text(doc))]


def _spans(doc: Path) -> list[str]:
    """Inline code of the prose (fenced blocks left out), a line break inside one as a space."""
    return [re.sub(r"\s*\n\s*", " ", m.group(1)) for m in SPAN.finditer(FENCE.sub("", _text(doc)))]


def _block_lines(body: str) -> list[str]:
    """A shell block's command lines: continuations (a trailing backslash, or the indented
    lines of a usage synopsis) joined, comments dropped."""
    lines: list[str] = []
    for raw in body.replace("\\\n", " ").splitlines():
        line = re.sub(r"(^|\s)#.*", "", raw).rstrip()
        if lines and re.match(r"[ \t]+[\[-]", line) and COMMAND.search(lines[-1]):
            lines[-1] += " " + line.strip()
        elif line.strip():
            lines.append(line.strip())
    return lines


@lru_cache(maxsize=None)
def commands(doc: Path) -> list[str]:
    """Every ``nonstop ...`` command line the document shows, from "nonstop" on."""
    found = []
    for lang, body in _blocks(doc):
        if lang in SHELL_BLOCKS:
            for line in _block_lines(body):
                m = COMMAND.search(line)
                if m:
                    found.append(line[m.start():])
    for span in _spans(doc):
        m = COMMAND.search(span)
        if m:
            found.append(span[m.start():])
    return found


def _tokens(command: str) -> list[str]:
    """The words after "nonstop", up to a shell operator; usage brackets and "..." dropped."""
    try:
        words = shlex.split(command)
    except ValueError:  # an unbalanced quote in prose
        words = command.split()
    out = []
    for word in words[1:]:
        if word in SHELL_OPERATORS or word.startswith((">", "|")):
            break
        word = word.lstrip("[").rstrip(".").rstrip("]")
        if word and word != "|":
            out.append(word)
    return out


def _placeholder(word: str) -> bool:
    """RUN_DIR, SCRIPT, FILE, N, <run>, nonstop-runs/<run>, $VAR, ...: not a literal value."""
    return not re.search(r"[a-z]", word) or "<" in word or "$" in word or "..." in word


# -- the CLI's own parser --------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _parser() -> argparse.ArgumentParser:
    return build_parser()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _all_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out = [parser]
    for sub in _subparsers(parser).values():
        out += _all_parsers(sub)
    return out


@lru_cache(maxsize=None)
def all_flags() -> frozenset[str]:
    return frozenset(s for p in _all_parsers(_parser()) for a in p._actions
                     for s in a.option_strings)


def _check_inject(spec: str) -> list[str]:
    if _placeholder(spec):
        return []
    try:
        inject.parse([spec])
    except UsageError as exc:
        return [f"--inject {spec}: {exc}"]
    return []


def check_command(command: str) -> list[str]:
    """What is wrong with a ``nonstop ...`` line: an unknown subcommand, a flag its subcommand does
    not take, a choice it does not offer, an --inject spec it refuses. Placeholders pass; the
    script's own arguments (after SCRIPT) are not nonstop's."""
    return _walk(_parser(), _tokens(command), "nonstop")


def _walk(parser: argparse.ArgumentParser, words: list[str], prog: str) -> list[str]:
    problems: list[str] = []
    subs = _subparsers(parser)
    options = {s: a for a in parser._actions for s in a.option_strings}
    positionals = [a for a in parser._actions
                   if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if re.match(r"-[-a-zA-Z]", word):
            name, eq, value = word.partition("=")
            action = options.get(name)
            if action is None:
                problems.append(f"`{prog}` has no flag {name}")
                continue
            if action.nargs == argparse.REMAINDER:
                break  # (--script SCRIPT ...: the rest are the script and its arguments)
            if action.nargs != 0 and not eq and i < len(words):
                value = words[i]
                i += 1
            if name == "--inject" and value:
                problems += _check_inject(value)
            continue
        if subs:
            name = re.sub(r"[^a-z-]+$", "", word)
            if _placeholder(word):
                return problems
            if name not in subs:
                return problems + [f"`{prog}` has no subcommand {name!r}"]
            return problems + _walk(subs[name], words[i:], f"{prog} {name}")
        if not positionals:
            continue
        action = positionals.pop(0)
        if action.choices and not _placeholder(word) and word not in action.choices:
            problems.append(f"`{prog}` has no {action.dest} {word!r}")
        if positionals and positionals[0].nargs == argparse.REMAINDER:
            break  # the rest are the script's arguments
    return problems


# -- flags, keys and policies in the prose ---------------------------------------------------------
def prose_flags(doc: Path) -> list[tuple[str, str]]:
    """(flag, its inline code) for every --flag the prose names outside a nonstop command line,
    another tool's command line, or a script's arguments."""
    out = []
    for span in _spans(doc):
        if COMMAND.search(span):
            continue
        words = [w for w in span.split() if not re.match(r"[A-Z_][A-Z0-9_]*=", w)]
        if words and words[0] in OTHER_TOOLS:
            continue
        for word in words:
            if word.endswith((".py", ".sh")):
                break  # what follows is the script's
            m = re.match(r"\[?(--[a-zA-Z][\w-]*)", word)
            if m:
                out.append((m.group(1), span))
    return out


def resolves(key: str) -> bool:
    """Whether a dotted policy key names a field of the schema (list items by index or ``[]``;
    ``timeouts.``, ``levels.`` and ``scale_in.`` short for their place under ``recover``)."""
    parts = re.findall(r"[a-z_]\w*|\d+|\[\]", key)
    parts = [*SHORT_KEYS.get(parts[0], parts[:1]), *parts[1:]]
    node: typing.Any = policy.Policy
    for part in parts:
        if part.isdigit() or part == "[]":
            if typing.get_origin(node) is not list:
                return False
            node = typing.get_args(node)[0]
        elif isinstance(node, type) and issubclass(node, BaseModel) and part in node.model_fields:
            node = node.model_fields[part].annotation
        else:
            return False
    return True


def policy_keys(doc: Path) -> list[tuple[str, str]]:
    out = []
    for span in _spans(doc):
        for m in POLICY_KEY.finditer(span):
            key = m.group(1)
            if key.rsplit(".", 1)[-1] not in FILE_SUFFIXES and key not in NOT_POLICY:
                out.append((key, span))
    return out


def policy_texts(doc: Path) -> list[str]:
    """The policies a document spells out: its ```yaml blocks, and files written with printf."""
    texts = [body for lang, body in _blocks(doc) if lang in ("yaml", "yml")]
    for lang, body in _blocks(doc):
        if lang in SHELL_BLOCKS:
            texts += [m.group(1).encode().decode("unicode_escape")
                      for m in re.finditer(r"printf '([^']*)' > \S+\.ya?ml", body)]
    return texts


# -- the checks ------------------------------------------------------------------------------------
@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_every_command_shown_is_accepted_by_the_cli(doc):
    problems = [f"{cmd!r}: {p}" for cmd in commands(doc) for p in check_command(cmd)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_every_flag_named_in_the_prose_exists(doc):
    unknown = [f"{flag} (in `{span}`)" for flag, span in prose_flags(doc)
               if flag not in all_flags() and flag not in FOREIGN_FLAGS]
    assert not unknown, "no subcommand of nonstop takes:\n" + "\n".join(unknown)


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_every_policy_key_named_exists(doc):
    unknown = [f"{key} (in `{span}`)" for key, span in policy_keys(doc) if not resolves(key)]
    assert not unknown, "not in the policy schema:\n" + "\n".join(unknown)


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_fault_specs_in_the_prose_parse(doc):
    specs = [s for s in _spans(doc) if re.fullmatch(r"([a-z_]+):[a-z_]+=[\w=,;:]+", s)
             and s.split(":", 1)[0] in inject.KINDS]
    problems = [p for s in specs for p in _check_inject(s)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_nothing_is_deferred_to_a_release_to_come(doc):
    stale = [line.strip() for line in _text(doc).splitlines() if DEFERRED.search(line)]
    assert not stale, ("say what the code does now (and check it), not what a release will do:\n"
                       + "\n".join(stale))


def test_usage_names_every_flag_of_nonstop_run():
    run = _subparsers(_parser())["run"]
    usage = _text(ROOT / "docs" / "usage.md")
    missing = [s for a in run._actions for s in a.option_strings
               if s.startswith("--") and s != "--help"
               and not re.search(f"`{re.escape(s)}(?![\\w-])", usage)]
    assert not missing, "docs/usage.md does not name: " + ", ".join(missing)


def test_policies_spelled_out_in_the_docs_load():
    # docs/policy.md's example is tests/test_policy.py's
    texts = [t for doc in DOCS if doc.name != "policy.md" for t in policy_texts(doc)]
    assert len(texts) >= 2  # README's elastic.yaml (printf) and docs/elastic.md's
    for text in texts:
        policy.load_text(text, "a policy in the docs")


def test_the_docs_are_read_as_meant():
    """The extraction itself: it finds the commands, flags and keys the docs hold, so that the
    checks above cannot pass by reading nothing."""
    shown = [c for doc in DOCS for c in commands(doc)]
    subs = {_tokens(c)[0] for c in shown if _tokens(c)}
    assert {"run", "bench", "chaos", "drain", "report", "status", "policy"} <= subs
    assert len(shown) > 100
    usage = ROOT / "docs" / "usage.md"
    synopsis = [c for c in commands(usage) if "--checkpoint-every" in c]
    assert synopsis and "SCRIPT" in synopsis[0]  # the synopsis' lines joined into one command
    assert ("--etcd-cacert", "--etcd-cacert") in prose_flags(usage)
    assert ("hosts.store_outage_s", "hosts.store_outage_s") in policy_keys(usage)


@pytest.mark.parametrize("command, words", [
    ("nonstop run --etcd-ca ca.pem train.py", "`nonstop run` has no flag --etcd-ca"),
    ("nonstop run --nproc=2 --tls x train.py", "`nonstop run` has no flag --tls"),
    ("nonstop serve --port 1", "`nonstop` has no subcommand 'serve'"),
    ("nonstop bench crashes --json", "`nonstop bench` has no scenario 'crashes'"),
    ("nonstop policy shw", "`nonstop policy` has no subcommand 'shw'"),
    ("nonstop run --inject meteor:rank=0,step=1 train.py", "--inject meteor:rank=0,step=1"),
    ("nonstop drain RUN_DIR --ranks 1", "`nonstop drain` has no flag --ranks"),
])
def test_the_check_finds_what_is_wrong(command, words):
    problems = check_command(command)
    assert len(problems) == 1 and words in problems[0], problems


@pytest.mark.parametrize("command", [
    "nonstop run --nproc 4 train.py --steps 10 --no-such-flag-of-nonstop",  # the script's
    "nonstop run [--nproc N] [--inject SPEC]... SCRIPT [SCRIPT ARGS...]",
    "nonstop report nonstop-runs/<run> --html",
    "nonstop policy show > policy.yaml",
    "nonstop status --rdzv-endpoint etcd://10.0.0.5:2379 --rdzv-id job42",
    "nonstop run --nproc 4 --inject \"crash:rank=2,step=50;hang:rank=1,step=80\" train.py",
])
def test_the_check_passes_what_is_right(command):
    assert check_command(command) == []


def test_the_stale_sentences_it_was_written_for_are_caught():
    for sentence in ["(If the lost pod ran the elected controller, the job stops with exit 1 today",
                     "In this release `nonstop run` has no flags for a CA",
                     "the job waits for MAX for now, and scaling in is the next release"]:
        assert DEFERRED.search(sentence), sentence
    assert not resolves("recover.levels.scale_in.min_hosts") and resolves("scale_in.min_world")
    assert resolves("detect.log_rules[].pattern") and resolves("detect.loss_rules.0.threshold")
    assert not resolves("detect.hang.steady.florr_s") and not resolves("hosts.py")


# -- what runs here in a moment --------------------------------------------------------------------
def _nonstop(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(nonstop_cmd(*args), capture_output=True, text=True, timeout=60, cwd=cwd)


@pytest.mark.integration
def test_the_help_of_every_command_shown_runs():
    shown = {tuple(_tokens(c)[:2]) for doc in DOCS for c in commands(doc) if _tokens(c)}
    helps = [("--help",)]
    helps += sorted({(sub, "--help") for sub, *_ in shown if sub in _subparsers(_parser())})
    # each bench scenario the docs show, as `nonstop bench <x> --help`
    helps += sorted({(sub, rest[0], "--help") for sub, *rest in shown
                     if sub == "bench" and rest and not _placeholder(rest[0])})
    assert len(helps) > 10
    procs = [(args, subprocess.Popen(nonstop_cmd(*args), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=ROOT))
             for args in helps]
    failed = []
    for args, proc in procs:
        out, err = proc.communicate(timeout=60)
        if proc.returncode != 0 or not out.startswith("usage: nonstop"):
            failed.append(f"nonstop {' '.join(args)}: exit {proc.returncode}: {err.strip()}")
    assert not failed, "\n".join(failed)


@pytest.mark.integration
def test_policy_show_into_a_file_then_check_it_as_the_readme_does(tmp_path):
    # `nonstop policy show > policy.yaml`, then `nonstop policy check policy.yaml` (docs/policy.md);
    # tests/test_policy.py has the rest of `policy show` and `policy check`
    shown = _nonstop("policy", "show")
    assert shown.returncode == 0 and "detect:" in shown.stdout, shown.stderr
    (tmp_path / "policy.yaml").write_text(shown.stdout)
    checked = _nonstop("policy", "check", "policy.yaml", cwd=tmp_path)
    assert (checked.returncode, checked.stdout, checked.stderr) == (0, "policy.yaml: OK\n", "")
