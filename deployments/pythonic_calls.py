"""The `pythonic` tool call parser's format (vLLM's `pythonic`: Llama 3.2's with vLLM's
pythonic chat template, Llama 4's, ToolACE's): the whole output is one Python list of calls
with keyword arguments of literal values, `[get_weather(city="Paris"), f(x=1, y=[1, 2])]`,
read with `ast` (never evaluated), each call's arguments sent as JSON; any other output is
content.

The head of a list of calls (`[`, a function's name, `(`) is read as the output streams
(CallHead), so an output that cannot be calls goes out from where that is known; one that
may be waits for its end. The read is bounded: ast's tokenizer refuses brackets nested 200
deep, and an output past MAX_CALLS_CHARS is content, streamed or whole.
"""

import ast
import json
import re
import string
import warnings

from deployments.held_text import SentContent

# past this many characters an output is content: ast's work is linear, but a list of small
# literals costs it about 2 us and 0.5 KB a character (400k characters of `f(),`: 0.85 s
# of the router's event loop and 210 MB), 15 to 70 times json's
MAX_CALLS_CHARS = 1 << 16
NAME_LENGTH = 64  # OpenAI's limit on a function's name (deployments.tools checks the offered)
NAME_START = string.ascii_letters + "_"
NAME_REST = re.compile(r"[A-Za-z0-9_]*")
SPACE = re.compile(r"\s*")


class CallHead:
    """Whether an output opens (after whitespace) with `[`, a function's name (ASCII, at most
    NAME_LENGTH characters) and `(`, whitespace allowed between them, read as it streams:
    each delta costs its own length."""

    def __init__(self) -> None:
        self.expected = "["  # what comes next after whitespace: "[", "name", "("
        self.name = 0  # the length of the name read so far, while inside it
        self.opens: bool | None = None

    def feed(self, text: str) -> bool | None:
        """Whether the output opens so, once the text so far tells (else None)."""
        at = 0
        while self.opens is None and at < len(text):
            if self.name:  # inside the name: it goes on, or ends (then whitespace and "(")
                end = NAME_REST.match(text, at).end()
                self.name += end - at
                if self.name > NAME_LENGTH:
                    self.opens = False
                elif end < len(text):
                    self.name, self.expected = 0, "("
                at = end
                continue
            at = SPACE.match(text, at).end()
            if at == len(text):
                break
            char, at = text[at], at + 1
            if char == "[" and self.expected == "[":
                self.expected = "name"
            elif char in NAME_START and self.expected == "name":
                self.name = 1
            else:
                self.opens = char == "(" and self.expected == "("
        return self.opens


def read_pythonic(text: str, names: set[str]) -> tuple[None, list[tuple[str, str]]] | None:
    """(None, [(name, arguments as JSON)]) when the output is a list of calls of offered
    functions with keyword arguments of literal values (after whitespace; Python statements
    after the list are dropped, as vLLM drops them); None when it is content."""
    if len(text) > MAX_CALLS_CHARS or not CallHead().feed(text):
        return None
    try:
        with warnings.catch_warnings():  # an invalid escape's in the model's strings
            warnings.simplefilter("ignore")
            module = ast.parse(text.strip())
    # MemoryError: the parser's own stack limit (a long chain of unary operators)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    first = module.body[0]
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.List)):
        return None
    calls = [read_call(node) for node in first.value.elts]
    if any(call is None or call[0] not in names for call in calls):
        return None
    return None, calls


def read_call(node: ast.expr) -> tuple[str, str] | None:
    """(name, arguments as JSON) of a call of a name with keyword arguments of literal
    values (the last of a repeated keyword, as vLLM's); None for any other expression."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
        return None
    if any(keyword.arg is None for keyword in node.keywords):  # `**mapping`
        return None
    try:
        arguments = {keyword.arg: literal(keyword.value) for keyword in node.keywords}
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)  # as vLLM's
        try:
            text.encode()
        except UnicodeEncodeError:  # a lone surrogate (`"\ud800"`): escaped, as UTF-8 can't
            text = json.dumps(arguments, allow_nan=False)
    except (ValueError, RecursionError):  # not a literal, or an infinite float (`1e999`)
        return None
    return node.func.id, text


def literal(node: ast.expr):
    """The JSON value of a literal: a string, a number (a negative one too), True, False,
    None, or a list or dict of literals (the dict's keys strings); ValueError for any other
    expression (a tuple, a set, bytes, a name, an operation)."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (str, int, float)):  # bool: an int
            return node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        number = node.operand
        if isinstance(number, ast.Constant) and type(number.value) in (int, float):
            return -number.value if isinstance(node.op, ast.USub) else number.value
    elif isinstance(node, ast.List):
        return [literal(item) for item in node.elts]
    elif isinstance(node, ast.Dict):
        # a None key: `**mapping`
        if all(isinstance(key, ast.Constant) and isinstance(key.value, str)
               for key in node.keys):
            return {key.value: literal(value) for key, value in zip(node.keys, node.values)}
    raise ValueError(f"not a literal: {type(node).__name__}")


class HeldPythonic(SentContent):
    """pythonic's held content: an output that opens as a list of calls (CallHead) waits
    for its end (calls, or content after all) unless it grows past MAX_CALLS_CHARS; any
    other goes out as it comes, from where it is known not to be calls. Each delta costs
    its own length (what is held is kept in its deltas' pieces, joined once)."""

    def __init__(self) -> None:
        self.head = CallHead()
        self.held: list[str] | None = []  # None once known to be content
        self.length = 0  # the characters held

    def feed(self, delta: str) -> str:
        """The part of the output so far that can go out now."""
        if self.held is not None:
            self.held.append(delta)
            self.length += len(delta)
            if self.head.feed(delta) is not False and self.length <= MAX_CALLS_CHARS:
                return ""
            delta, self.held = "".join(self.held), None
        self.sent += len(delta)
        return delta
