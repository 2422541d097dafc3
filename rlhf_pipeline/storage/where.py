"""The ``--where`` language of ``rlhf-pipeline filter``: a small, safe condition over stored rows.

Why one file: the names, the checker and the evaluator are one grammar; every construct the
checker admits is one the evaluator runs, and keeping them side by side is what keeps them equal.

An expression is Python syntax, parsed with :mod:`ast` and checked against a whitelist (the names of
:data:`ROW_NAMES`, :data:`GROUP_NAMES` and :data:`TRAJECTORY_NAMES`, numbers, arithmetic, comparisons,
``and``/``or``/``not``) before anything is evaluated, never ``eval``-ed; anything else is a
:class:`WhereError`. :class:`WhereExpression` evaluates it on NumPy columns, one bool per row.
Design: docs/curation.md#filter.
"""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from rlhf_pipeline.schema.termination import TerminationReason
from rlhf_pipeline.schema.tool_errors import ToolErrorKind

MAX_EXPRESSION_CHARS = 2000
# the reasons' names stand for their codes in expressions (NOT_ENDED is 0: rows before the last)
REASON_CODES: dict[str, int] = {reason.name: int(reason) for reason in TerminationReason}


class WhereError(ValueError):
    """A ``--where`` expression that cannot be used; the message says why and how to fix it."""


@dataclass(frozen=True)
class RowName:
    """A per-row value: which stored fields it reads and how it is computed from them."""

    fields: tuple[str, ...]
    compute: Callable[[dict[str, np.ndarray]], np.ndarray]
    kind: str  # "number" or "bool"
    doc: str


def _column(name: str) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    return lambda columns: columns[name]


def _lengths(name: str) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    # token fields arrive as their (N+1) offsets, so a length is a difference, not a read of the values
    return lambda columns: np.diff(columns[name])


#: Row-level names. ``position`` is the row's position in the filtered buffer (0 = oldest held).
ROW_NAMES: dict[str, RowName] = {
    "reward": RowName(("reward",), _column("reward"), "number", "the row's scalar reward"),
    "advantage": RowName(("advantage",), _column("advantage"), "number",
                         "the stored group-relative advantage (buffers that hold it)"),
    "policy_version": RowName(("policy_version",), _column("policy_version"), "number",
                              "version of the weights that sampled the row"),
    "response_length": RowName(("response_tokens",), _lengths("response_tokens"), "number",
                               "response tokens"),
    "prompt_length": RowName(("prompt_tokens",), _lengths("prompt_tokens"), "number", "prompt tokens"),
    "step": RowName(("step",), _column("step"), "number", "turn index within the trajectory"),
    "done": RowName(("done",), _column("done"), "bool", "the trajectory ends at this row"),
    "terminated": RowName(("terminated",), _column("terminated"), "bool", "ended naturally (EOS)"),
    "truncated": RowName(("truncated",), _column("truncated"), "bool", "ended by a limit"),
    "group_id": RowName(("group_id",), _column("group_id"), "number", "the row's group id"),
    "trajectory_id": RowName(("trajectory_id",), _column("trajectory_id"), "number", "the row's trajectory id"),
    "collector": RowName(("group_id",), lambda c: c["group_id"] >> 40, "number",
                         "index of the collector that wrote the row (from its group id)"),
    "termination_reason": RowName(("termination_reason",), _column("termination_reason"), "number",
                                  "why the trajectory ended, on its done row (NOT_ENDED = 0 on the others)"),
    "tool_calls": RowName(("tool_calls",), _column("tool_calls"), "number",
                          "tool calls the model wrote in this turn (agent buffers)"),
    "tool_errors": RowName(("tool_errors",), _column("tool_errors"), "number",
                           "of this turn's tool calls, those answered with an error (agent buffers)"),
    **{f"tool_error_{kind.name.lower()}": RowName(
        ("tool_error_kinds",), lambda c, bit=int(kind): (c["tool_error_kinds"] & bit) != 0, "bool",
        f"a tool call of this turn failed as {kind.name.lower()} (agent buffers)") for kind in ToolErrorKind},
    "position": RowName((), lambda c: c["position"], "number", "position of the row in the source buffer"),
}

#: Group-level names: statistics of the row's group over its rows in the filtered buffer.
GROUP_NAMES: dict[str, str] = {
    "group_size": "rows of the group",
    "group_reward_mean": "mean reward of the group",
    "group_reward_std": "standard deviation of the group's rewards (population, ddof=0); 0 when all are equal",
    "group_reward_min": "lowest reward in the group",
    "group_reward_max": "highest reward in the group",
}

FUNCTIONS: dict[str, tuple[int, int | None, Callable]] = {  # name -> (min args, max args, numpy function)
    "abs": (1, 1, np.abs),
    "min": (2, None, np.minimum),
    "max": (2, None, np.maximum),
}

_BINARY = {ast.Add: np.add, ast.Sub: np.subtract, ast.Mult: np.multiply, ast.Div: np.true_divide,
           ast.Mod: np.mod}
_COMPARE = {ast.Eq: np.equal, ast.NotEq: np.not_equal, ast.Lt: np.less, ast.LtE: np.less_equal,
            ast.Gt: np.greater, ast.GtE: np.greater_equal}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Mod: "%", ast.Pow: "**",
           ast.FloorDiv: "//", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^", ast.LShift: "<<",
           ast.RShift: ">>", ast.MatMult: "@", ast.Is: "is", ast.IsNot: "is not", ast.Invert: "~"}


# statistics of the row's trajectory (its rows in the buffer being filtered); read in a first pass
TRAJECTORY_NAMES: dict[str, str] = {
    "trajectory_turns": "rows (model turns) of the row's trajectory",
    "trajectory_return": "sum of the rewards of the trajectory's rows",
    "trajectory_end": "the trajectory's termination_reason (that of its done row; NOT_ENDED if that row is absent)",
    "trajectory_tool_calls": "tool calls over the trajectory's turns (the sum of tool_calls)",
    "trajectory_tool_errors": "failed tool calls over the trajectory's turns (the sum of tool_errors)",
}
# the stored field each trajectory statistic needs beyond trajectory_id and reward
TRAJECTORY_FIELDS: dict[str, str] = {"trajectory_end": "termination_reason",
                                     "trajectory_tool_calls": "tool_calls",
                                     "trajectory_tool_errors": "tool_errors"}


def valid_names() -> list[str]:
    return [*ROW_NAMES, *GROUP_NAMES, *TRAJECTORY_NAMES, *REASON_CODES]


def describe_names() -> str:
    """The valid names and what they mean, one per line (``filter --list-names``)."""
    lines = ["row values:"]
    lines += [f"  {name:<26} {spec.doc}" for name, spec in ROW_NAMES.items()]
    lines.append("group statistics (over the group's rows in the buffer being filtered):")
    lines += [f"  {name:<26} {doc}" for name, doc in GROUP_NAMES.items()]
    lines.append("trajectory statistics (over the trajectory's rows in the buffer being filtered):")
    lines += [f"  {name:<26} {doc}" for name, doc in TRAJECTORY_NAMES.items()]
    lines.append("termination reasons (codes, for termination_reason and trajectory_end):")
    lines.append("  " + ", ".join(f"{name} = {code}" for name, code in REASON_CODES.items()))
    return "\n".join(lines)


class WhereExpression:
    """A checked ``--where`` expression; build with :func:`parse_where`."""

    def __init__(self, text: str, tree: ast.Expression, names: frozenset[str]) -> None:
        self.text = text
        self._tree = tree
        self.names = names

    @property
    def uses_groups(self) -> bool:
        """True when some name is a group statistic (the filter then makes a first pass)."""
        return any(name in GROUP_NAMES for name in self.names)

    @property
    def uses_trajectories(self) -> bool:
        """True when some name is a trajectory statistic (a first pass over the trajectories)."""
        return any(name in TRAJECTORY_NAMES for name in self.names)

    @property
    def fields(self) -> tuple[str, ...]:
        """Stored fields the row names read (group statistics need ``group_id`` and ``reward``)."""
        needed = {f for name in self.names if name in ROW_NAMES for f in ROW_NAMES[name].fields}
        if self.uses_groups:
            needed.add("group_id")
        if self.uses_trajectories:
            needed.add("trajectory_id")
        return tuple(sorted(needed))

    def evaluate(self, columns: dict[str, np.ndarray], num_rows: int) -> np.ndarray:
        """One bool per row. ``columns`` holds each stored field of :attr:`fields` (token fields
        as their ``num_rows + 1`` offsets), ``position``, and the group statistics it uses."""
        values = {}
        for name in self.names:
            values[name] = ROW_NAMES[name].compute(columns) if name in ROW_NAMES else columns[name]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            result = _Evaluator(values).visit(self._tree.body)
        return np.broadcast_to(np.asarray(result, dtype=bool), (num_rows,))

    def __repr__(self) -> str:
        return f"WhereExpression({self.text!r})"


def parse_where(text: str, *, stored_fields: tuple[str, ...] | None = None) -> WhereExpression:
    """Parses and checks ``text``; :class:`WhereError` says what is wrong and how to fix it.

    ``stored_fields`` (the buffer's schema) turns a name whose field the buffer lacks (such as
    ``advantage`` in a buffer written without it) into an error here, before any row is read.
    """
    if not isinstance(text, str) or not text.strip():
        raise WhereError("the --where expression is empty; write a condition such as 'group_reward_std > 0'")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise WhereError(f"the --where expression is {len(text)} characters long; the limit is {MAX_EXPRESSION_CHARS}")
    # columns in messages count in ``text`` as given, though the parser sees it stripped
    indent = len(text) - len(text.lstrip())
    stripped = text.strip()
    try:
        tree = ast.parse(stripped, mode="eval")
    except SyntaxError as exc:
        if not exc.offset or exc.offset > len(stripped):  # Python points at 0 when the input ends early
            where = f"it ends after column {indent + len(stripped)} where more was expected"
        else:
            where = f"{exc.msg} at column {indent + exc.offset}"
        raise WhereError(f"cannot parse --where {text!r}: {where}") from None
    checker = _Checker(text, indent)
    kind = checker.visit(tree.body)
    if kind != "bool":
        raise WhereError(
            f"--where {text!r} is a number, not a condition; compare it, e.g. '{text.strip()} > 0'"
        )
    if stored_fields is not None:
        for name in sorted(checker.names):
            missing = [f for f in ROW_NAMES[name].fields if f not in stored_fields] if name in ROW_NAMES else []
            if name in TRAJECTORY_FIELDS and TRAJECTORY_FIELDS[name] not in stored_fields:
                missing = [TRAJECTORY_FIELDS[name]]
            if missing:
                raise WhereError(
                    f"--where uses {name!r}, but this buffer does not store field {missing[0]!r} "
                    f"(it stores {list(stored_fields)})"
                )
    return WhereExpression(text, tree, frozenset(checker.names))


# ====================================================================== checking
class _Checker(ast.NodeVisitor):
    """Walks the tree once: rejects anything off the whitelist, returns each node's kind."""

    def __init__(self, text: str, indent: int = 0) -> None:
        self.text = text
        self.indent = indent  # characters stripped before parsing, added back to node columns
        self.names: set[str] = set()

    def _reject(self, node: ast.AST, what: str) -> WhereError:
        column = getattr(node, "col_offset", None)
        where = f" at column {self.indent + column + 1}" if column is not None else ""
        return WhereError(
            f"--where {self.text!r}: {what}{where} is not allowed; the language has names, numbers, "
            f"+ - * / %, comparisons, 'in (...)', and/or/not, and abs/min/max"
        )

    def generic_visit(self, node: ast.AST) -> str:
        symbol = _SYMBOL.get(type(getattr(node, "op", None)))
        what = f"operator {symbol!r}" if symbol else type(node).__name__
        raise self._reject(node, what)

    def _expect(self, node: ast.AST, kind: str, role: str) -> None:
        got = self.visit(node)
        if got != kind:
            source = ast.get_source_segment(self.text.strip(), node) or type(node).__name__
            raise WhereError(f"--where {self.text!r}: {role} needs a {'condition' if kind == 'bool' else 'number'}, "
                             f"got {source!r}")

    def visit_Name(self, node: ast.Name) -> str:
        if node.id in ROW_NAMES:
            self.names.add(node.id)
            return ROW_NAMES[node.id].kind
        if node.id in GROUP_NAMES or node.id in TRAJECTORY_NAMES:
            self.names.add(node.id)
            return "number"
        if node.id in REASON_CODES:
            return "number"
        close = difflib.get_close_matches(node.id, valid_names(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else "."
        raise WhereError(f"--where {self.text!r}: unknown name {node.id!r}{hint} Valid names: "
                         f"{', '.join(valid_names())}")

    def visit_Constant(self, node: ast.Constant) -> str:
        if isinstance(node.value, bool):
            return "bool"
        if isinstance(node.value, (int, float)):
            return "number"
        raise self._reject(node, f"the constant {node.value!r}")

    def visit_BoolOp(self, node: ast.BoolOp) -> str:
        for value in node.values:
            self._expect(value, "bool", "'and' / 'or'")
        return "bool"

    def visit_UnaryOp(self, node: ast.UnaryOp) -> str:
        if isinstance(node.op, ast.Not):
            self._expect(node.operand, "bool", "'not'")
            return "bool"
        if isinstance(node.op, (ast.USub, ast.UAdd)):
            self._expect(node.operand, "number", "unary minus")
            return "number"
        return self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> str:
        if type(node.op) not in _BINARY:
            return self.generic_visit(node)
        self._expect(node.left, "number", "arithmetic")
        self._expect(node.right, "number", "arithmetic")
        return "number"

    def visit_Compare(self, node: ast.Compare) -> str:
        operands = [node.left, *node.comparators]
        for i, op in enumerate(node.ops):
            if isinstance(op, (ast.In, ast.NotIn)):
                self._expect(operands[i], "number", "'in'")
                self._check_members(operands[i + 1])
            elif type(op) in _COMPARE:
                for side in (operands[i], operands[i + 1]):
                    kind = self.visit(side)
                    if kind == "bool" and not isinstance(op, (ast.Eq, ast.NotEq)):
                        raise self._reject(node, "ordering a condition (use == or != on True/False)")
            else:
                return self.generic_visit(op)
        return "bool"

    def _check_members(self, node: ast.AST) -> None:
        if not isinstance(node, (ast.Tuple, ast.List, ast.Set)) or not node.elts:
            raise self._reject(node, "'in' needs a tuple of numbers such as (0, 2, 5); this")
        for element in node.elts:
            value = element.operand if isinstance(element, ast.UnaryOp) and isinstance(element.op, ast.USub) \
                else element
            if isinstance(value, ast.Name) and value.id in REASON_CODES:
                continue
            if not (isinstance(value, ast.Constant) and isinstance(value.value, (int, float))
                    and not isinstance(value.value, bool)):
                raise self._reject(element, "a member of 'in (...)' that is not a number")

    def visit_Call(self, node: ast.Call) -> str:
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name not in FUNCTIONS or node.keywords:
            raise self._reject(node, f"calling {ast.get_source_segment(self.text.strip(), node.func) or 'this'}")
        low, high = FUNCTIONS[name][:2]
        if len(node.args) < low or (high is not None and len(node.args) > high):
            count = f"{low}" if low == high else f"at least {low}"
            raise WhereError(f"--where {self.text!r}: {name}() takes {count} argument(s), got {len(node.args)}")
        for arg in node.args:
            self._expect(arg, "number", f"{name}()")
        return "number"


# ====================================================================== evaluation
class _Evaluator(ast.NodeVisitor):
    """Evaluates a checked tree over NumPy columns (every node was whitelisted by _Checker)."""

    def __init__(self, values: dict[str, np.ndarray]) -> None:
        self.values = values

    def visit_Name(self, node: ast.Name):
        return REASON_CODES[node.id] if node.id in REASON_CODES else self.values[node.id]

    def visit_Constant(self, node: ast.Constant):
        return node.value

    def visit_BoolOp(self, node: ast.BoolOp):
        combine = np.logical_and if isinstance(node.op, ast.And) else np.logical_or
        result = self.visit(node.values[0])
        for value in node.values[1:]:
            result = combine(result, self.visit(value))
        return result

    def visit_UnaryOp(self, node: ast.UnaryOp):
        operand = self.visit(node.operand)
        if isinstance(node.op, ast.Not):
            return np.logical_not(operand)
        return np.negative(operand) if isinstance(node.op, ast.USub) else operand

    def visit_BinOp(self, node: ast.BinOp):
        left, right = self.visit(node.left), self.visit(node.right)
        if isinstance(node.op, ast.Div):  # divide in float64 so int columns do not truncate
            return np.true_divide(np.asarray(left, dtype=np.float64), right)
        return _BINARY[type(node.op)](left, right)

    def visit_Compare(self, node: ast.Compare):
        result = True
        left = self.visit(node.left)
        for op, comparator in zip(node.ops, node.comparators):
            if isinstance(op, (ast.In, ast.NotIn)):
                members = [self.visit(e) for e in comparator.elts]
                found = np.isin(left, members)
                step = found if isinstance(op, ast.In) else np.logical_not(found)
                right = None
            else:
                right = self.visit(comparator)
                step = _COMPARE[type(op)](left, right)
            result = np.logical_and(result, step)
            left = right
        return result

    def visit_Call(self, node: ast.Call):
        function = FUNCTIONS[node.func.id][2]
        args = [self.visit(a) for a in node.args]
        result = args[0] if len(args) > 1 else function(args[0])
        for arg in args[1:]:
            result = function(result, arg)
        return result
