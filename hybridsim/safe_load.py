"""Bounded readers for every file hybridsim is given (scenarios, sweep files, traces, vLLM
recordings, workload files, expected files): a hostile file is bad input like any other.

Each limit is far above what a real file needs and low enough that refusing costs little time and
memory; a file past one is one ``InputError`` (exit 2) naming the file and line:

- YAML: nesting deeper than ``MAX_DEPTH`` levels; a document whose aliases expand past
  ``MAX_YAML_NODES`` nodes (a "billion laughs" is counted on PyYAML's node graph, where aliases are
  shared, before any Python object is built); an alias that contains itself; any tag other than
  plain data's (``!!python/object/apply`` and unknown tags); a file over ``MAX_YAML_BYTES``.
- JSON lines: a line over ``MAX_LINE_CHARS`` (read in bounded pieces, never whole); nesting past
  what the decoder allows; a number past Python's integer-string limit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any, Iterator

import yaml

from .errors import InputError, not_json, not_text

MAX_DEPTH = 64  # a scenario nests 4 levels; sweep files 3
MAX_YAML_NODES = 1_000_000  # expanded (aliases counted each time they are used)
MAX_YAML_BYTES = 8 << 20  # scenarios and sweep files are written by hand: a few KiB
MAX_LINE_CHARS = 64 << 20  # a trace or recording line: a step, or the requests with their prompts

_PLAIN_TAGS = frozenset([*(t for t in yaml.SafeLoader.yaml_constructors if t is not None),
                          "tag:yaml.org,2002:merge"])  # (``<<``: the merge key)


# ----------------------------------------------------------------------------- YAML


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader that stops composing past ``MAX_DEPTH`` levels (its composer
    recurses: 5,000 levels would be a RecursionError)."""

    def __init__(self, stream, source: str):
        super().__init__(stream)
        self.source = source
        self.depth = 0

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise InputError(f"nested more than {MAX_DEPTH} levels deep", f"{self.source}:{mark.line + 1}")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for kv in node.value for n in kv]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_graph(root: yaml.Node, source: str) -> None:
    """Tags, expanded size and expanded depth of a composed document, each node visited once
    (an alias is a shared node: its expansion is counted, not built)."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    entered: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        k = id(node)
        if done:
            kids = _children(node)
            size[k] = 1 + sum(size[id(c)] for c in kids)
            depth[k] = 1 + max((depth[id(c)] for c in kids), default=0)
            entered.discard(k)
            if size[k] > MAX_YAML_NODES:
                raise InputError(f"its aliases expand past {MAX_YAML_NODES:,} values (an alias bomb?)",
                                 f"{source}:{_line(node)}")
            if depth[k] > MAX_DEPTH:
                raise InputError(f"its aliases nest more than {MAX_DEPTH} levels deep", f"{source}:{_line(node)}")
            continue
        if k in size:
            continue
        if k in entered:
            raise InputError("an alias refers to a value that contains it", f"{source}:{_line(node)}")
        if node.tag not in _PLAIN_TAGS:
            raise InputError(f"tag {node.tag.replace('tag:yaml.org,2002:', '!!')} is not allowed (plain YAML "
                             "data only)", f"{source}:{_line(node)}")
        entered.add(k)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in size)


def _yaml_error(e: yaml.YAMLError, source: str) -> InputError:
    mark = getattr(e, "problem_mark", None)
    where = f"{source}:{mark.line + 1}" if mark is not None else source
    problem = getattr(e, "problem", None) or str(e)
    return InputError(f"not valid YAML: {problem}", where)


def _sized(text: str, source: str) -> None:
    if len(text) > MAX_YAML_BYTES:
        raise InputError(f"{len(text):,} characters: larger than a scenario or sweep file can be "
                         f"({MAX_YAML_BYTES:,})", source)


def compose_yaml(text: str, source: str) -> yaml.Node | None:
    """The document's node graph (line numbers for messages), checked: depth, tags, expansion."""
    _sized(text, source)
    loader = _BoundedLoader(text, source)
    try:
        node = loader.get_single_node()
    except yaml.YAMLError as e:
        raise _yaml_error(e, source) from None
    finally:
        loader.dispose()
    if node is not None:
        _check_graph(node, source)
    return node


def load_yaml(text: str, source: str) -> Any:
    """``yaml.safe_load`` within the limits above: a hostile document is an InputError."""
    _sized(text, source)
    loader = _BoundedLoader(text, source)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_graph(node, source)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise _yaml_error(e, source) from None
    finally:
        loader.dispose()


# ----------------------------------------------------------------------------- JSON


def load_json(text: str | bytes, where: str) -> Any:
    """``json.loads`` whose failures are all one InputError naming ``where``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise not_json(e, where) from None
    except RecursionError:
        raise InputError("not valid JSON here: nested too deeply", where) from None
    except UnicodeDecodeError as e:  # (bytes given)
        raise not_text(e, where) from None
    except ValueError as e:  # (a number past Python's integer-string limit)
        what = "a number too long to read" if "digits" in str(e) else str(e)
        raise InputError(f"not valid JSON here: {what}", where) from None


def bounded_lines(f: IO[str], where: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of a text file, each line read in bounded pieces: one longer than
    ``MAX_LINE_CHARS`` is refused before it is held in memory whole."""
    ln = 0
    while True:
        line = f.readline(MAX_LINE_CHARS + 1)
        if not line:
            return
        ln += 1
        if len(line) > MAX_LINE_CHARS:
            raise InputError(f"line longer than {MAX_LINE_CHARS:,} characters (not a trace or recording line)",
                             f"{where}:{ln}")
        yield ln, line


def read_json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, value) of every non-blank line of a JSON-lines file, bounded as above."""
    try:
        f = path.open(encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror}", str(path)) from None
    ln = 0
    with f:
        try:
            for ln, line in bounded_lines(f, str(path)):
                if line.strip():
                    yield ln, load_json(line, f"{path}:{ln}")
        except UnicodeDecodeError as e:  # (a binary file; ``ln``: the last line read whole)
            raise not_text(e, str(path), f", after line {ln}" if ln else "") from None
