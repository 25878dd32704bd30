"""sglang_plugin/patches.py: every write the plugin makes to SGLang's objects, each function
checked on stand-ins for SGLang's objects (what it writes, and where); and the scan that keeps
writes to SGLang's objects out of the other plugin modules."""
import ast
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "src" / "ddtree_sglang" / "sglang_plugin"

# --- The scan: who writes SGLang's objects ----------------------------------------------------

# Method calls whose result is a new object, whatever the receiver (any other method's result
# counts as its receiver's: a view, an element, or what an SGLang object hands out).
FRESH_METHODS = {"clone", "repeat", "copy", "tolist", "item", "numel", "size", "dim",
                 "new_zeros", "new_empty", "new_full", "new_ones", "new_tensor"}
# Methods that change their receiver: Python containers' (a tensor's end in "_", see below).
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault",
            "add", "discard", "popitem", "sort", "reverse"}
OWN_TYPE_NAMES = {"int", "float", "str", "bool", "bytes", "dict", "list", "tuple", "set",
                  "frozenset", "None", "Callable"}
ITERATORS = {"zip", "enumerate", "reversed", "sorted", "list", "tuple", "iter", "set",
             "filter"}


def _names(annotation: ast.expr) -> set[str]:
    """Every (dotted) name an annotation mentions."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    found = set()
    for node in ast.walk(annotation):
        if isinstance(node, ast.Attribute):
            found.add(ast.unparse(node))
        elif isinstance(node, ast.Name):
            found.add(node.id)
    return {n for n in found if not any(m.startswith(n + ".") for m in found)}


class Module:
    """What a module binds at its top and anywhere by import: SGLang's names (imported from
    SGLang or from sglang_api, and sglang_api itself) and the types that are the package's."""

    def __init__(self, tree: ast.Module) -> None:
        self.sglang, self.own_types = set(), set(OWN_TYPE_NAMES)
        self.class_attrs: dict[int, dict[str, bool]] = {}  # id(class) -> attribute -> SGLang's?
        self.busy: set = set()  # the bindings being judged (a binding may refer to itself)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    name = alias.asname or alias.name
                    if node.module.startswith("sglang") or node.module.endswith("sglang_api") \
                            or alias.name == "sglang_api":
                        self.sglang.add(name)
                    elif node.module.startswith("ddtree_sglang") and alias.name[0].isupper():
                        self.own_types.add(name)
            elif isinstance(node, ast.Import):
                self.sglang |= {a.asname or a.name for a in node.names
                                if a.name.startswith("sglang")}
            elif isinstance(node, ast.ClassDef):
                self.own_types.add(node.name)


class Scope:
    """One function's bindings (parameters, assignments, loop targets), inside its enclosing
    scopes; `foreign(expr)` says whether an expression may be an object SGLang owns (or
    reached from one) rather than one this code made."""

    def __init__(self, module: Module, fn=None, parent: "Scope | None" = None,
                 cls: ast.ClassDef | None = None) -> None:
        self.module, self.parent, self.cls = module, parent, cls
        self.params: dict[str, ast.expr | None] = {}
        self.bound: dict[str, list] = {}
        if fn is not None:
            args = fn.args
            for a in args.posonlyargs + args.args + args.kwonlyargs:
                self.params[a.arg] = a.annotation
            for a in (args.vararg, args.kwarg):
                if a is not None:
                    self.params[a.arg] = None
            body = fn.body if isinstance(fn.body, list) else [fn.body]
            for stmt in body:
                self._bind(stmt)

    # bindings
    def _add(self, target: ast.expr, how: tuple) -> None:
        if isinstance(target, ast.Name):
            self.bound.setdefault(target.id, []).append(how)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                self._add(t, how)
        elif isinstance(target, ast.Starred):
            self._add(target.value, how)

    def _bind_loop(self, target: ast.expr, iterable: ast.expr) -> None:
        call = iterable if isinstance(iterable, ast.Call) else None
        name = getattr(call.func, "id", None) if call else None
        if isinstance(target, ast.Tuple) and name == "zip" and len(call.args) == len(target.elts):
            for t, arg in zip(target.elts, call.args):
                self._bind_loop(t, arg) if isinstance(t, ast.Tuple) else self._add(t, ("elem", arg))
        elif isinstance(target, ast.Tuple) and name == "enumerate" and len(target.elts) == 2:
            self._add(target.elts[0], ("own",))  # the index
            self._add(target.elts[1], ("elem", call.args[0]))
        else:
            self._add(target, ("elem", iterable))

    def _bind(self, node: ast.AST) -> None:
        """Record the bindings of a statement and of the statements inside it (not inside
        nested functions or classes: those are scopes of their own)."""
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) and \
                        len(target.elts) == len(node.value.elts):
                    for t, v in zip(target.elts, node.value.elts):
                        self._add(t, ("expr", v))
                else:
                    self._add(target, ("expr", node.value))
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            self._add(node.target, ("expr", node.value))
        elif isinstance(node, ast.NamedExpr):
            self._add(node.target, ("expr", node.value))
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            self._bind_loop(node.target, node.iter)
        elif isinstance(node, ast.comprehension):
            self._bind_loop(node.target, node.iter)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            self._add(node.optional_vars, ("expr", node.context_expr))
        elif isinstance(node, ast.ExceptHandler) and node.name:
            self.bound.setdefault(node.name, []).append(("own",))
        for child in ast.iter_child_nodes(node):
            self._bind(child)

    # origins
    def _lookup(self, name: str):
        scope = self
        while scope is not None:
            if name in scope.bound or name in scope.params:
                return scope
            scope = scope.parent
        return None

    def _param_foreign(self, name: str) -> bool:
        if name in ("self", "cls") and self.cls is not None:
            return self.sglang_subclass()
        annotation = self.params[name]
        return annotation is None or not _names(annotation) <= self.module.own_types

    def sglang_subclass(self) -> bool:
        """Whether this scope's class derives from one of SGLang's (its `self` is SGLang's
        object, its inherited buffers SGLang's)."""
        return any(n.split(".")[0] in self.module.sglang
                   for b in self.cls.bases for n in _names(b))

    def _how_foreign(self, how: tuple) -> bool:
        if how[0] == "own":
            return False
        return self.foreign(how[1]) if how[0] == "expr" else self.element_foreign(how[1])

    def _name_foreign(self, name: str) -> bool:
        scope = self._lookup(name)
        if scope is None:  # a module's global or a builtin
            return name in self.module.sglang
        key = (id(scope), name)
        if key in self.module.busy:  # a binding that refers to itself (x = x.view(...))
            return False
        self.module.busy.add(key)
        try:
            if name in scope.params:
                return scope._param_foreign(name)
            return any(scope._how_foreign(how) for how in scope.bound[name])
        finally:
            self.module.busy.discard(key)

    def self_attr_foreign(self, attr: str) -> bool:
        """A `self` attribute (this scope is a method's) is SGLang's where the class is an
        SGLang class, or where a method sets it from an object that may be SGLang's (a handle
        on an object it was given)."""
        return self.sglang_subclass() or self.class_attrs().get(attr, False)

    def class_attrs(self) -> dict[str, bool]:
        """Attribute -> whether some method of this scope's class sets it from an object that
        may be SGLang's (cached per class; filled as it is computed, so reads of attributes
        not yet known count as the class's own)."""
        attrs = self.module.class_attrs.get(id(self.cls))
        if attrs is None:
            attrs = self.module.class_attrs[id(self.cls)] = {}
            for method in self.cls.body:
                if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                inner = Scope(self.module, method, self.parent, self.cls)
                for node in ast.walk(method):
                    if not isinstance(node, ast.Assign):
                        continue
                    for target in node.targets:
                        pairs = zip(target.elts, node.value.elts) \
                            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) \
                            and len(target.elts) == len(node.value.elts) \
                            else [(t, node.value) for t in getattr(target, "elts", [target])]
                        for t, v in pairs:
                            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                                    and t.value.id == "self":
                                attrs[t.attr] = attrs.get(t.attr, False) or inner.foreign(v)
        return attrs

    def foreign(self, expr: ast.expr) -> bool:
        """Whether `expr` may be SGLang's object (or one reached from it)."""
        if isinstance(expr, ast.Name):
            return self._name_foreign(expr.id)
        if isinstance(expr, ast.Attribute):
            base = expr.value
            if isinstance(base, ast.Name) and base.id == "self":
                scope = self._lookup("self")
                if scope is not None and scope.cls is not None:
                    return scope.self_attr_foreign(expr.attr)
            return self.foreign(base)
        if isinstance(expr, (ast.Subscript, ast.Starred)):
            return self.foreign(expr.value)
        if isinstance(expr, ast.Call):
            func = expr.func
            if isinstance(func, ast.Attribute):
                if func.attr in FRESH_METHODS:
                    return False
                return self.foreign(func.value)
            if isinstance(func, ast.Name) and self._lookup(func.id) is not None:
                return self._name_foreign(func.id)  # a function handed in: SGLang's result
            return isinstance(func, ast.Name) and func.id in self.module.sglang
        if isinstance(expr, ast.IfExp):
            return self.foreign(expr.body) or self.foreign(expr.orelse)
        if isinstance(expr, ast.BoolOp):
            return any(self.foreign(v) for v in expr.values)
        if isinstance(expr, ast.NamedExpr):
            return self.foreign(expr.value)
        return False  # literals, displays, comprehensions, arithmetic: new objects

    def element_foreign(self, expr: ast.expr) -> bool:
        """Whether an element of the iterable `expr` may be SGLang's."""
        if isinstance(expr, ast.Name):
            scope = self._lookup(expr.id)
            key = ("elements", id(scope), expr.id)
            if scope is None or expr.id not in scope.bound or key in self.module.busy:
                return self.foreign(expr)
            self.module.busy.add(key)
            try:  # an element of what the name holds, or of the elements it ranges over
                return any(scope.element_foreign(h[1]) for h in scope.bound[expr.id]
                           if h[0] != "own")
            finally:
                self.module.busy.discard(key)
        if isinstance(expr, ast.Call):
            func = expr.func
            if isinstance(func, ast.Name) and func.id in ITERATORS | {"range"} and \
                    self._lookup(func.id) is None:
                return any(self.element_foreign(a) for a in expr.args)
            if isinstance(func, ast.Attribute) and func.attr in ("items", "values", "keys"):
                return self.element_foreign(func.value)
            return self.foreign(expr)
        if isinstance(expr, (ast.Tuple, ast.List, ast.Set)):
            return any(self.foreign(e) for e in expr.elts)
        if isinstance(expr, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
            inner = Scope(self.module, None, self, None)
            for gen in expr.generators:
                inner._bind(gen)
            return inner.foreign(expr.elt)
        return self.foreign(expr)


def _root(expr: ast.expr) -> ast.expr:
    while isinstance(expr, (ast.Attribute, ast.Subscript)):
        expr = expr.value
    return expr


def _writes(scope: Scope, body: list, where: str, found: set) -> None:
    """Each write in `body` (not in nested scopes) into an object that may be SGLang's."""
    def flag(what: str) -> None:
        found.add(f"{where}: {what}")

    def target(t: ast.expr) -> None:
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                target(e)
        elif isinstance(t, ast.Subscript) and scope.foreign(t.value):
            flag(ast.unparse(t))
        elif isinstance(t, ast.Attribute) and not t.attr.startswith("__"):
            root = _root(t)
            if not (isinstance(root, ast.Name) and root.id in ("self", "cls")):
                flag(ast.unparse(t))  # anything's attribute but the object's own
            elif t.value is not root and scope.foreign(t.value):
                flag(ast.unparse(t))  # self.<an SGLang object>.x

    stack = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Assign):
            for t in node.targets:
                target(t)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                if scope.foreign(node.target):  # `x += y` changes a tensor or a list in place
                    flag(ast.unparse(node))
            else:
                target(node.target)
        elif isinstance(node, ast.Delete):
            for t in node.targets:
                if isinstance(t, ast.Subscript):
                    target(t)
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute):
                inplace = func.attr.endswith("_") and not func.attr.startswith("_")
                if (inplace or func.attr in MUTATORS) and scope.foreign(func.value):
                    flag(ast.unparse(func))
            if getattr(func, "id", None) == "setattr":
                flag("setattr")
            for kw in node.keywords:
                if kw.arg and (kw.arg == "out" or kw.arg.endswith("_out")) and \
                        scope.foreign(kw.value):
                    flag(f"{ast.unparse(func)}({kw.arg}={ast.unparse(kw.value)})")
        stack.extend(ast.iter_child_nodes(node))


def sglang_writes(source: str, name: str) -> set[str]:
    """'<name> <function>: <expression>' for every write in `source` into an object that may
    be SGLang's: an attribute set on anything but the object's own `self`, an item set or
    deleted, an in-place tensor method (`x.copy_`, `.fill_`, `.index_put_`: a name ending in
    one underscore), a container's mutator (`.append`, `.extend`, ...), an `out=` / `*_out=`
    argument, `x += ...`.  Objects made here (literals, torch's constructors, the package's
    own calls), parameters annotated with the package's types, a module's own globals and the
    attributes a non-SGLang class sets from such objects count as the code's own; parameters
    without such an annotation, SGLang's calls' results, a subclass of an SGLang class's
    `self`, and anything reached from them, as SGLang's."""
    tree = ast.parse(source)
    module = Module(tree)
    found: set[str] = set()

    def visit(node, scope: Scope, prefix: str, cls=None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, scope, f"{prefix}{child.name}.", child)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = Scope(module, child, scope, cls)
                qual = f"{prefix}{child.name}"
                _writes(inner, child.body, f"{name} {qual}", found)
                visit(child, inner, qual + ".")
            elif isinstance(child, ast.Lambda):
                inner = Scope(module, child, scope)
                _writes(inner, [child.body], f"{name} {prefix}<lambda>", found)
                visit(child, inner, prefix)
            else:
                visit(child, scope, prefix, cls)

    top = Scope(module)
    for stmt in tree.body:
        top._bind(stmt)
    _writes(top, tree.body, f"{name} <module>", found)
    visit(tree, top, "")
    return found


def test_the_scan_finds_writes_into_sglang_s_objects_and_only_those():
    """The scan on a module written to hold each kind of write: into SGLang's objects (a
    buffer of the worker it was handed, reached through an alias; the batch's tensors; a
    request's list; an `out=` tensor handed in; an SGLang subclass's own buffers), and into
    its own (a buffer it made, its class's, a parameter of the package's type)."""
    source = textwrap.dedent('''
        import torch
        from ddtree_sglang.sglang_plugin import sglang_api as sg
        from ddtree_sglang.sglang_plugin.grammar_stage import MaskCosts

        class IO:
            def __init__(self, worker, costs: MaskCosts):
                self.worker, self.costs = worker, costs
                self.buf = torch.zeros(3)

            def step(self, batch, stream, out: torch.Tensor):
                w, n = self.worker, 2
                cpu_buf = w._draft_seq_lens_cpu_buf[:n]
                cpu_buf.copy_(batch.seq_lens)
                batch.seq_lens.record_stream(stream)
                self.buf.copy_(batch.seq_lens)
                mine = torch.empty(3)
                mine[0] = 1
                self.costs.us["r"] = 1.0
                batch.seq_lens[0] = 1
                torch.argmax(batch.seq_lens, out=out)
                for i, req in enumerate(batch.reqs):
                    req.output_ids.append(i)
                rows = batch.seq_lens.view(-1)
                rows += 1
                self.worker.block_size = 4
                fb = sg.ForwardBatch(seq_lens=mine)
                fb.positions.fill_(0)

        class Input(sg.DFlashDraftInputV2):
            def prepare(self, bs: int):
                self._buf[:bs].zero_()
                self.max_top_k = 1
        ''')
    assert sglang_writes(source, "m.py") == {
        "m.py IO.step: cpu_buf.copy_",
        "m.py IO.step: batch.seq_lens[0]",
        "m.py IO.step: torch.argmax(out=out)",
        "m.py IO.step: req.output_ids.append",
        "m.py IO.step: rows += 1",
        "m.py IO.step: self.worker.block_size",
        "m.py IO.step: fb.positions.fill_",
        "m.py Input.prepare: self._buf[:bs].zero_",
    }


# Writes into SGLang's objects outside patches.py that the scan finds today, each with why it
# stands (to move into patches.py): 'file function: expression'.
_DFLASH_LENGTHS = ("DFLASH's per-batch length buffers (DFlashDraftInputV2."
                   "_ensure_prepare_length_buffers), filled as DFLASH's prepare_for_decode fills "
                   "them (this is its copy, contract.COPIED) before alloc_for_spec_decode reads "
                   "them")
_DRAFT_BLOCK = ("DFLASH's draft-block buffers, filled by SGLang's own kernel as "
                "DFlashWorkerV2.forward_batch_generation calls it (the block draft is its copy, "
                "contract.COPIED)")
_OUTPUT_IDS = ("Req.output_ids cut to the tokens inside max_new_tokens while SGLang's own "
               "finish checks read them, restored in a finally")
SGLANG_WRITES_ELSEWHERE = {
    "draft_input.py DDTreeDraftInput.prepare_for_decode: committed_cpu[i]": _DFLASH_LENGTHS,
    "draft_input.py DDTreeDraftInput.prepare_for_decode: cur_cpu[i]": _DFLASH_LENGTHS,
    "draft_input.py DDTreeDraftInput.prepare_for_decode: nxt_cpu[i]": _DFLASH_LENGTHS,
    "draft_input.py DDTreeDraftInput.prepare_for_decode: cur.copy_": _DFLASH_LENGTHS,
    "draft_input.py DDTreeDraftInput.prepare_for_decode: nxt.copy_": _DFLASH_LENGTHS,
    "model_io.py DFlashModelIO.draft_block: cpu_buf.copy_":
        "DFLASH's _draft_seq_lens_cpu_buf, the host lengths of the draft forward batch, filled "
        "as DFLASH's block draft fills it (contract.COPIED)",
    "model_io.py DFlashModelIO.draft_block: "
    "sg.prepare_dflash_draft_block(block_ids_out=block_ids)": _DRAFT_BLOCK,
    "model_io.py DFlashModelIO.draft_block: "
    "sg.prepare_dflash_draft_block(positions_out=positions_2d)": _DRAFT_BLOCK,
    "model_io.py DFlashModelIO.draft_block: "
    "sg.prepare_dflash_draft_block(cache_loc_out=cache_loc_2d)": _DRAFT_BLOCK,
    "plugin.py _finish_state_hook: req.output_ids[cut:]": _OUTPUT_IDS,
    "plugin.py _finish_state_hook: req.output_ids.extend": _OUTPUT_IDS,
}
# Writes the scan cannot prove the code's own that are: each with whose object it is.
OWN_WRITES_THE_SCAN_CANNOT_PROVE = {
    "decode_step.py sample_per_node: torch.argmax(out=out)":
        "out is the accept stage's input buffer (GraphedStages.accept.inputs), handed in by "
        "DecodeStep.sample_and_accept; the scan counts a tensor parameter as SGLang's",
}


def test_only_patches_writes_sglang_s_objects():
    """Every plugin module but patches.py only reads the objects SGLang hands it (batch,
    requests, logits output, results, server arguments, the worker's and DFLASH's buffers):
    the scan finds no other write into them than the ones listed above, and each listed one
    is still there (a moved write leaves the list)."""
    found = set()
    for f in sorted(PLUGIN.glob("*.py")):
        if f.name != "patches.py":
            found |= sglang_writes(f.read_text(), f.name)
    assert found == set(SGLANG_WRITES_ELSEWHERE) | set(OWN_WRITES_THE_SCAN_CANNOT_PROVE)


# --- Each write, on stand-ins for SGLang's objects ---------------------------------------------

@pytest.fixture
def patches():
    pytest.importorskip("sglang", reason="patches.py reads SGLang's names")
    from ddtree_sglang.sglang_plugin import patches

    return patches


def test_drafter_forward_keeps_its_embeds_dtype(patches):
    """SGLang's eager extend path hands bf16 input_embeds to an fp16 drafter: the forward of
    that one model casts them to its dtype and keeps its signature."""
    import inspect

    import torch

    class Drafter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4).half()

        def forward(self, input_ids, positions, forward_batch, input_embeds=None):
            return self.proj.weight.dtype, input_embeds.dtype

    model, other = Drafter(), Drafter()
    patches.keep_embeds_dtype(model, torch.float16)
    # SGLang's graph runner passes input_embeds only if the signature names it
    assert "input_embeds" in inspect.signature(model.forward).parameters
    bf16 = torch.zeros(3, 4, dtype=torch.bfloat16)
    assert model.forward(None, None, None, input_embeds=bf16) == (torch.float16, torch.float16)
    assert model.forward(None, None, None, input_embeds=bf16.half())[1] == torch.float16
    assert other.forward(None, None, None, input_embeds=bf16)[1] == torch.bfloat16  # one model
    with pytest.raises(AttributeError):  # no embeds: the model's own behaviour, untouched
        model.forward(None, None, None)


def test_verify_attention_is_installed_on_the_triton_backend_only(patches):
    """wrap_verify_attention swaps the target triton backend's extend kernel for the wrapped
    one (the kernel choice checked it); any other backend is refused by name, untouched."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from ddtree_sglang.sglang_plugin import sglang_api as sg

    def single(*a, **k):
        return "single"

    backend = TritonAttnBackend.__new__(TritonAttnBackend)  # no GPU state needed here
    backend.extend_attention_fwd = single
    seen = []

    def wrap(fn, merge, signature):
        seen.append((fn, merge, tuple(signature.parameters)[:2]))
        return lambda *a, **k: "split"

    patches.wrap_verify_attention(backend, wrap)
    assert backend.extend_attention_fwd() == "split"
    assert seen[0][0] is single and seen[0][2] == ("q_extend", "k_extend")
    assert seen[0][1] is sg.merge_state_triton

    class Other:
        extend_attention_fwd = single

    other = Other()
    with pytest.raises(RuntimeError, match="backend is Other"):
        patches.wrap_verify_attention(other, wrap)
    assert vars(other) == {} and len(seen) == 1  # nothing set on it
    assert sg.is_triton_attention(backend) and not sg.is_triton_attention(other)


def test_the_tail_hook_joins_the_runner_s_capture_tail_hooks(patches):
    from types import SimpleNamespace

    def dflash_sampler(*a):
        return None

    def tree_stage(*a):
        return None

    runner = SimpleNamespace(capture_tail_hooks=[dflash_sampler])
    patches.add_capture_tail_hook(runner, tree_stage)
    assert runner.capture_tail_hooks == [dflash_sampler, tree_stage]  # SGLang's own kept


def test_server_argument_declarations(patches):
    """Outside a ServerArgs (tests) the fields are set directly; a ServerArgs without the
    override pass DDTREE declares through is refused, naming the supported SGLang, before
    anything is set."""
    from types import SimpleNamespace

    from ddtree_sglang.sglang_plugin import sglang_api as sg

    args = SimpleNamespace(attention_backend=None)
    patches.declare_server_args(args, {"attention_backend": "triton"})
    assert args.attention_backend == "triton"
    bare = sg.ServerArgs.__new__(sg.ServerArgs)  # no _resolved_overrides: another SGLang
    with pytest.raises(RuntimeError, match="no _resolved_overrides .* supports SGLang 0.5.17"):
        patches.declare_server_args(bare, {"attention_backend": "triton"})
    assert "attention_backend" not in vars(bare)
    fields = SimpleNamespace(max_running_requests=None, enable_mixed_chunk=True)
    patches.set_server_fields(fields, {"max_running_requests": 48, "enable_mixed_chunk": False})
    assert fields == SimpleNamespace(max_running_requests=48, enable_mixed_chunk=False)


def test_a_verify_runtime_is_built_under_its_width_and_the_configured_one_restored(
        patches, monkeypatch):
    """build_verify_runtime makes the backend and the graph runner while SGLang's speculative
    width reads `width` (the runner sizes its graphs by it), installs `prepare_backend` before
    the graphs are captured, restores the configured width and the runner's workspace flag,
    also when building fails; set_verify_runtime puts a pair on the target runner."""
    from types import SimpleNamespace

    from ddtree_sglang.sglang_plugin import sglang_api as sg

    spec = SimpleNamespace(speculative_num_draft_tokens=33)

    class Context:
        def override(self, source, **fields):
            vars(spec).update(fields)

    class Runner:
        def __init__(self, model_runner, attn_backend, speculative_num_draft_tokens):
            self.backend, self.width = attn_backend, speculative_num_draft_tokens
            self.spec_width = spec.speculative_num_draft_tokens
            self.prepared = attn_backend.prepared

    class ModelRunner:
        init_new_workspace = False
        decode_cuda_graph_runner = "configured graphs"

        def _get_attention_backend(self, init_new_workspace):
            self.init_new_workspace = init_new_workspace  # SGLang leaves its flag set
            return SimpleNamespace(spec_width=spec.speculative_num_draft_tokens, prepared=False)

    monkeypatch.setattr(sg, "get_context", Context)
    monkeypatch.setattr(sg, "runtime_spec", lambda: spec)
    monkeypatch.setattr(sg, "DecodeCudaGraphRunner", Runner)
    runner = ModelRunner()
    backend, graphs = patches.build_verify_runtime(
        runner, 9, prepare_backend=lambda b: setattr(b, "prepared", True))
    assert backend.spec_width == 9 and graphs.spec_width == 9 and graphs.width == 9
    assert graphs.backend is backend and graphs.prepared
    assert spec.speculative_num_draft_tokens == 33 and runner.init_new_workspace is False

    runner.decode_cuda_graph_runner = None  # CUDA graphs off: no graph runner
    assert patches.build_verify_runtime(runner, 17)[1] is None

    def fails(init_new_workspace):
        raise MemoryError("no room for another backend")

    runner._get_attention_backend = fails
    with pytest.raises(MemoryError):
        patches.build_verify_runtime(runner, 5)
    assert spec.speculative_num_draft_tokens == 33 and runner.init_new_workspace is False

    target = SimpleNamespace(attn_backend="b33", decode_cuda_graph_runner="g33")
    patches.set_verify_runtime(target, (backend, graphs))
    assert target.attn_backend is backend and target.decode_cuda_graph_runner is graphs


def test_per_request_values_go_to_the_logits_output_s_customized_info(patches):
    import torch
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    out = LogitsProcessorOutput(next_token_logits=torch.zeros(2, 3))
    assert out.customized_info is None
    patches.report_per_request(out, "ddtree_budget", [8, 8])
    assert out.customized_info == {"ddtree_budget": [8, 8]}
    out.customized_info["other"] = ["x", "y"]
    patches.report_per_request(out, "ddtree_budget", [16, 16])
    assert out.customized_info == {"ddtree_budget": [16, 16], "other": ["x", "y"]}


def test_batch_lengths(patches):
    """clamp_seq_lens replaces the batch's lengths by a clamped copy (the scheduler's stream
    may still read the tensor it made); set_host_seq_lens sets the host copies."""
    from types import SimpleNamespace

    import torch

    scheduler_s = torch.tensor([5, 40, 12])
    batch = SimpleNamespace(seq_lens=scheduler_s, seq_lens_cpu=None, seq_lens_sum=None)
    patches.clamp_seq_lens(batch, 30)
    assert batch.seq_lens.tolist() == [5, 30, 12] and batch.seq_lens is not scheduler_s
    assert scheduler_s.tolist() == [5, 40, 12]
    host = torch.tensor([5, 30, 12])
    patches.set_host_seq_lens(batch, host, 47)
    assert batch.seq_lens_cpu is host and batch.seq_lens_sum == 47


def test_the_verify_input_and_host_bound_on_the_batch(patches):
    """verify_on_batch leaves the verify input on the batch (as DFLASH does) and holds the
    step's host bound only inside the block, restoring the batch's own after, also when the
    block fails."""
    from types import SimpleNamespace

    batch = SimpleNamespace(spec_info="relay", seq_lens_cpu="host lens", seq_lens_sum=10)
    with patches.verify_on_batch(batch, "verify input", "bound", 99):
        assert (batch.spec_info, batch.seq_lens_cpu, batch.seq_lens_sum) == \
            ("verify input", "bound", 99)
    assert (batch.spec_info, batch.seq_lens_cpu, batch.seq_lens_sum) == \
        ("verify input", "host lens", 10)
    with pytest.raises(KeyError):
        with patches.verify_on_batch(batch, "again", "bound", 99):
            raise KeyError("prepare failed")
    assert (batch.seq_lens_cpu, batch.seq_lens_sum) == ("host lens", 10)


def test_logits_output_fields(patches):
    """drop_hidden_states empties the features; set_output_logprobs writes the logprob
    fields it is given and leaves the others as they were."""
    import torch
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    out = LogitsProcessorOutput(next_token_logits=torch.zeros(2, 3),
                                hidden_states=torch.ones(2, 4))
    patches.drop_hidden_states(out)
    assert out.hidden_states is None and out.next_token_logits is not None
    lp = torch.tensor([-0.5, -1.0])
    patches.set_output_logprobs(out, lp)
    assert out.next_token_logprobs is lp and out.next_token_top_logprobs_val is None
    assert out.next_token_token_ids_logprobs_val is None
    patches.set_output_logprobs(out, lp, top=("top values", "top ids"),
                                token_ids=("id values", "ids"))
    assert (out.next_token_top_logprobs_val, out.next_token_top_logprobs_idx) == \
        ("top values", "top ids")
    assert (out.next_token_token_ids_logprobs_val, out.next_token_token_ids_logprobs_idx) == \
        ("id values", "ids")


def test_a_prefill_s_result_carries_its_lengths_and_relay_state(patches):
    import torch

    from ddtree_sglang.sglang_plugin import sglang_api as sg

    result = sg.GenerationBatchResult()
    lens, relay = torch.tensor([7, 9]), object()
    patches.finish_prefill(result, lens, relay)
    assert result.new_seq_lens is lens and result.next_draft_input is relay


def test_a_request_s_logprobs_are_hidden_only_inside_the_block(patches):
    from types import SimpleNamespace

    req = SimpleNamespace(return_logprob=True)
    with patches.logprobs_hidden(req):
        assert req.return_logprob is False
    assert req.return_logprob is True
    with pytest.raises(ValueError):
        with patches.logprobs_hidden(req):
            raise ValueError("DFLASH's check failed")
    assert req.return_logprob is True
    plain = SimpleNamespace(return_logprob=False)
    with patches.logprobs_hidden(plain):
        pass
    assert plain.return_logprob is False


def test_the_prefill_s_grammar_mask_is_cleared(patches):
    from types import SimpleNamespace

    info = SimpleNamespace(grammar_mask="the prefill's mask", vocab_size=10)
    patches.reset_grammar_mask(info)
    assert info.grammar_mask is None and info.vocab_size == 10
