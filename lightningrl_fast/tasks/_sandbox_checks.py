"""Result checks of the code sandbox: what a test may take from the program, and when.

Loaded by `_sandbox_harness` (by path, before any untrusted code: the harness runs as a script under
``python -I``, so this directory is not on ``sys.path``); standard library only. Everything here is built
before untrusted code and reads only parameter defaults bound then (no globals, no closure cells), so a
program patching builtins, stdlib modules or this module's globals changes nothing here.

PLAIN values (the "AlwaysEqual" reward hack: an object whose ``__eq__``/``__lt__``/``__bool__``/``__sub__``
... lies to the test's comparison). Every callable value the test namespace takes from the program's globals
(functions, lambdas, classes, bound methods, partials, callable instances; not modules, not the ``typing``
module's own objects, not a pristine builtin under its own name) is handed to the test as
``MethodType(call_checked, f)`` (`make_checker`). A call from the test then fails with ``NonPlainResult``
(a ``BaseException``: an ``except Exception`` in a test cannot swallow it) unless:

* the result is PLAIN: every object reachable from it has an exact type (``type(o) is T``, never
  ``isinstance`` or ``o.__class__``) among ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``,
  ``bytes``, ``bytearray``, ``range``, ``decimal.Decimal`` (leaves), ``list``, ``tuple``, ``set``,
  ``frozenset``, ``collections.deque``, ``dict`` views, ``dict``, ``collections.Counter`` /
  ``OrderedDict`` / ``defaultdict`` (keys and values; their instance ``__dict__`` must be empty, a
  ``defaultdict``'s factory ``None`` or one of these types), ``fractions.Fraction`` (both slots exact
  ``int``), or an instance of an INERT program class: no metaclass, only classes created at run time
  above ``object``, no dunder in their dicts beyond ``__init__`` and class metadata (so no ``__eq__``,
  ``__hash__``, ``__bool__``, ``__class__``, ``__getattr__``, ``__slots__``, ``__repr__``, ``__str__``,
  ...: it compares by identity), whose instance ``__dict__`` (keys and values) is checked the same way
  (test-built arguments like MBPP's ``Pair(5, 24)`` and tree nodes stay usable). Subclasses of the value
  types (``namedtuple`` included), dataclasses, enums, exceptions and anything else are not plain. The walk
  is iterative with a visited set (cycles, depth), reads objects only through the exact types' C slots and
  descriptors bound before untrusted code, and visits at most `PLAIN_LIMIT` (200 000) objects per value:
  larger, or any error, counts as not plain;
* an iterator of an allowlisted C type (generator, ``map``, ``filter``, ``zip``, ``enumerate``,
  ``reversed``, container iterators, ``itertools`` objects) is drained first (at most `PLAIN_LIMIT`
  items, so an endless one fails), its items checked as a list and handed on as ``iter(list)``: later
  program code cannot change an item already yielded;
* no thread of the program is left (``ProgramThreadAlive`` otherwise, below), checked before the value;
* every argument that was plain before the call is still plain after it (a solution putting an
  AlwaysEqual into the test's list), and so is every value checked earlier in the same test (``held``:
  a later call cannot change what an earlier one returned); arguments are kept alive to the end of the
  test (no weakref callback of the program between the check and the comparison);
* the stdlib the tests use is untouched: the restored modules' attributes and ``sys.modules`` entries,
  and the class dicts of the allowlisted types that are mutable (``Counter``, ``Fraction`` and the
  ``numbers`` ABCs), compared by identity with a snapshot taken before the program ran;
* no automatic garbage collection (hence no finalizer of the program) runs between the check and the
  test's comparison: ``gc`` is enabled for the call and disabled right after it.

ATTRIBUTES of program objects (methods, properties, class attributes of an inert instance the test holds:
``Stack().pop()``, ``build(xs).to_list()``, a setup fixture's ``root.value()``). The tests are compiled by
`compile_test` with every attribute load ``x.name`` rewritten to ``__lrl_getattr__(x, 'name')``
(`getattr_checked`; the tests' ``getattr``/``hasattr`` go through it too). For anything but a program object
it is the builtin ``getattr``. A program object is an instance of an inert class, an inert class, or the
object behind a wrapped callable (``Calc.add`` on the wrapped class ``Calc``). For those, when the lookup
itself runs no program code (an inert class or instance, a function or a builtin; the instance dict's keys
exact ``str``; the class attribute found first along the MRO, read raw from the class dicts, absent, a
function, a ``staticmethod``, a ``classmethod`` of a function, a C descriptor or an object of a builtin type
without ``__get__``), the value is handed over if plain, wrapped like the program's globals if callable (so
a method's result is checked when the test calls it), refused otherwise (an AlwaysEqual class attribute);
any other lookup (a ``property`` or another descriptor, an object of a class created at run time as class
attribute, a class with a metaclass or dunders, a callable instance) runs as ``call_checked(getattr, obj,
name)``: its value must be plain. Plain values handed over are ``held`` as above; objects found plain since
the program last ran are not walked again (``verified``, emptied before every call of the program: a
linked list walked node by node stays linear). Private names (``x.__y``, mangled inside a class) are not
rewritten.

THREADS of the program (a thread that changes a checked value, patches the stdlib or a class after the check
and before the comparison). No thread of the program may be alive when a check is made or a test runs:
`make_thread_check` builds ``quiet(workers)``, true once the process has no thread but the harness's own
(main, supervisor and ``workers`` stage workers), waiting up to `THREAD_GRACE_S` for threads that are
ending. It is asked after every program call of a test (before its result is checked), after the solution
and setup stages, and before and after each test; a program thread still alive then fails the stage / the
test with ``ProgramThreadAlive``. Both counts must agree: ``_thread._count()`` (interpreter threads, read
under the GIL) and the entries of ``/proc/self/task`` (every OS thread, a thread still running a finalizer
after it left the interpreter's count included). Threads the program starts and joins within one call
(``threading.Thread`` + ``join``, ``with ThreadPoolExecutor() as ex``) are fine; a pool left open (idle
workers) or a thread that outlives the call is not.
"""

import _thread
import ast
import collections
import gc
import itertools
import os
import sys
import time
import types

# Most objects the plainness check visits in one value (result, argument or materialised iterator);
# a larger value counts as not plain. HumanEval / MBPP results are far smaller.
PLAIN_LIMIT = 200_000
# Dunder names an "inert" program class may define (anything else, e.g. __eq__, __hash__, __bool__,
# __class__, __getattr__, __slots__, __repr__, __str__, __new__, makes its instances not plain).
INERT_DUNDERS = frozenset(("__module__", "__qualname__", "__doc__", "__init__", "__dict__", "__weakref__",
                           "__annotations__", "__firstlineno__", "__static_attributes__"))
# How long a check waits for the program's other threads to end before failing the test.
THREAD_GRACE_S = 0.5
# The name the tests' rewritten attribute loads call (a dunder: never mangled inside a class body).
GETATTR = "__lrl_getattr__"
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class created at run time


class _AttributeLoads(ast.NodeTransformer):
    """``x.name`` (a load) -> ``__lrl_getattr__(x, 'name')``; stores, deletes, private names and the value
    patterns of ``match`` statements (which must stay dotted names) are left alone."""

    def visit_Attribute(self, node):
        self.generic_visit(node)
        if type(node.ctx) is not ast.Load or (node.attr.startswith("__") and not node.attr.endswith("__")):
            return node
        call = ast.Call(func=ast.Name(id=GETATTR, ctx=ast.Load()), args=[node.value, ast.Constant(node.attr)],
                        keywords=[])
        return ast.copy_location(call, node)

    def visit_MatchValue(self, node):
        return node


def compile_test(source, filename):
    """The code object of a test, its attribute loads routed through ``getattr_checked`` (run by the
    supervisor before any untrusted code: the program cannot patch ``ast`` under it). SyntaxError as
    ``compile``."""
    tree = _AttributeLoads().visit(ast.parse(source, filename, "exec"))
    return compile(ast.fix_missing_locations(tree), filename, "exec", dont_inherit=True)


def make_thread_check(_count=getattr(_thread, "_count", None), _listdir=os.listdir, _len=len):
    """``quiet(workers)`` (see the module docstring), built on the supervisor thread before untrusted code,
    when the process has exactly two threads (main and supervisor). ``/proc/self/task`` is used when it
    shows them then; ``_thread._count()`` when the interpreter has it (it counts the supervisor)."""
    try:
        proc = _len(_listdir("/proc/self/task")) == 2
    except OSError:
        proc = False
    if _count is not None and _count() != 1:
        _count = None

    def quiet(workers, _count=_count, _proc=proc, _listdir=_listdir, _len=len, _sleep=time.sleep,
              _now=time.monotonic, _grace=THREAD_GRACE_S, _min=min):
        """True once no thread but the harness's (main, supervisor, ``workers`` workers) is alive; False
        if the program's threads are still there after ``_grace`` seconds (or the count cannot be read)."""
        deadline = None
        delay = 0.0005
        while True:
            ok = _count is None or _count() == 1 + workers
            if ok and _proc:
                try:
                    ok = _len(_listdir("/proc/self/task")) == 2 + workers
                except BaseException:
                    ok = False
            if ok:
                return True
            now = _now()
            if deadline is None:
                deadline = now + _grace
            elif now >= deadline:
                return False
            _sleep(delay)
            delay = _min(delay * 2, 0.02)

    return quiet


def make_checker(restored, quiet, _type=type, _id=id, _frozenset=frozenset, _tuple=tuple, _dict=dict,
                 _sys=sys):
    """Build the result check of the tests, before any untrusted code (``quiet``: `make_thread_check`'s).
    Returns ``(call_checked, getattr_checked, builtins_for_tests, (held, alive, verified), protected_ids,
    protected)``.
    ``call_checked(f, *args, **kw)`` (handed to the tests as ``MethodType(call_checked, f)``) calls a
    callable of the program and returns its result only if it is PLAIN (rules: the module docstring);
    ``getattr_checked(obj, name)`` is what the tests' attribute loads call (`compile_test`);
    ``builtins_for_tests`` replaces ``getattr``/``hasattr`` in the tests' builtins. The supervisor
    empties ``held``, ``alive`` and ``verified`` (`plain`'s cache) before each test.
    Every function here reads only its own parameters (defaults bound now; the audit hook refuses
    ``object.__setattr__``/``__delattr__`` on the ``protected`` objects, so ``__code__``/``__defaults__``
    cannot be swapped), no globals and no closure cells, and calls no method of an object that is not of
    an exact allowlisted type."""
    import decimal
    import fractions

    NoneType = _type(None)
    Counter, OrderedDict = collections.Counter, collections.OrderedDict
    defaultdict, deque, Fraction = collections.defaultdict, collections.deque, fractions.Fraction
    scalars = (NoneType, bool, int, float, complex, str, bytes, bytearray, range, decimal.Decimal)
    d = {}
    sequences = (list, tuple, set, frozenset, deque, _type(d.keys()), _type(d.values()), _type(d.items()))
    mappings = (dict, Counter, OrderedDict, defaultdict)
    # instance __dict__ of an allowlisted type (Counter, OrderedDict): must stay empty (an attribute there
    # would shadow a method such as ``most_common``)
    inst_dicts = _tuple((_id(t), t.__dict__["__dict__"]) for t in mappings + sequences if "__dict__" in t.__dict__)
    factories = _frozenset(_id(t) for t in scalars[1:] + sequences[:5] + mappings if t is not range)
    mro_of = type.__dict__["__mro__"].__get__
    flags_of = type.__dict__["__flags__"].__get__
    tdict_of = type.__dict__["__dict__"].__get__
    # allowlisted types whose class attributes can be changed (pure-Python classes: Counter, Fraction and
    # the numbers ABCs): snapshot of their dicts, compared after every call
    mutable = []
    for t in scalars + sequences + mappings + (Fraction,):
        for c in mro_of(t):
            if not flags_of(c) & (1 << 8) and all(c is not m for m, _ in mutable):  # Py_TPFLAGS_IMMUTABLETYPE
                mutable.append((c, _tuple(tdict_of(c).items())))
    iterators = [types.GeneratorType, map, filter, zip, enumerate, reversed, _type(iter(lambda: 0, 1))]
    for sample in ([], (), range(1), range(1 << 70), "a", "\xe9", "\U0001f600", b"", bytearray(), set(), d,
                   d.values(), d.items(), deque()):
        iterators.append(_type(iter(sample)))
    for sample in ([], d, d.values(), d.items(), deque(), range(1)):
        iterators.append(_type(reversed(sample)))
    for name in ("chain", "islice", "count", "cycle", "repeat", "accumulate", "product", "permutations",
                 "combinations", "combinations_with_replacement", "starmap", "takewhile", "dropwhile",
                 "compress", "zip_longest", "filterfalse", "pairwise", "batched", "groupby"):
        t = getattr(itertools, name, None)
        if _type(t) is type:
            iterators.append(t)
    iterators.append(_type(itertools.tee([])[0]))

    class NonPlainResult(BaseException):  # BaseException: an ``except Exception`` in a test cannot eat it
        pass

    def inert(t, _type=_type, _typetype=type, _mro=mro_of, _flags=flags_of, _tdict=tdict_of, _object=object,
              _str=str, _starts=str.startswith, _ends=str.endswith, _items=types.MappingProxyType.items,
              _ok=INERT_DUNDERS, _getset=types.GetSetDescriptorType):
        """A class of the program whose instances compare by identity and have nothing but attributes: no
        metaclass, only heap types (classes created at run time) above ``object``, no dunder outside
        `INERT_DUNDERS`."""
        if _type(t) is not _typetype:
            return False
        mro = _mro(t)
        if _type(mro) is not tuple or mro[-1] is not _object:
            return False
        for c in mro[:-1]:
            if _type(c) is not _typetype or not _flags(c) & (1 << 9):  # Py_TPFLAGS_HEAPTYPE
                return False
            for k, v in _items(_tdict(c)):
                if _type(k) is not _str:
                    return False
                if _starts(k, "__") and _ends(k, "__"):
                    if k not in _ok:
                        return False
                    if (k == "__dict__" or k == "__weakref__") and _type(v) is not _getset:
                        return False
        return True

    def plain(root, _type=_type, _id=_id, _set=set, _scalars=_frozenset(_id(t) for t in scalars),
              _seqs=_frozenset(_id(t) for t in sequences), _maps=_frozenset(_id(t) for t in mappings),
              _inst_dicts=inst_dicts, _dd=_id(defaultdict), _ddf=defaultdict.__dict__["default_factory"],
              _factories=factories, _frac=_id(Fraction),
              _frac_slots=(Fraction.__dict__["_numerator"], Fraction.__dict__["_denominator"]),
              _member_get=types.MemberDescriptorType.__get__, _getset_get=types.GetSetDescriptorType.__get__,
              _int=int, _dict=dict, _items=dict.items, _len=len, _inert=inert,
              _getattr=object.__getattribute__, _limit=PLAIN_LIMIT, _cache=None, _cget=dict.get,
              _cset=dict.__setitem__):
        """True if every object reachable from ``root`` has an exact allowlisted type (or is an instance
        of an `inert` class, whose ``__dict__`` values are then checked the same way). Iterative (cycles
        and depth are fine), at most ``_limit`` objects; any error counts as not plain. ``_cache``: a dict
        ``id -> object`` of objects found plain since the program last ran (`call_checked` empties it before
        each call); they are not walked again, and a successful walk adds what it visited."""
        try:
            seen = _set()
            stack = [root]
            n = 0
            visited = [] if _cache is not None else None
            while stack:
                o = stack.pop()
                t = _type(o)
                ti = _id(t)
                if ti in _scalars:
                    continue
                oi = _id(o)
                if oi in seen:
                    continue
                if visited is not None:
                    if _cget(_cache, oi) is o:
                        continue
                    visited.append(o)
                n += 1
                if n > _limit:
                    return False
                seen.add(oi)
                if ti in _seqs:
                    stack.extend(o)
                elif ti in _maps:
                    for kv in _items(o):
                        stack.extend(kv)
                    if ti == _dd:
                        f = _member_get(_ddf, o, t)
                        if f is not None and _id(f) not in _factories:
                            return False
                elif ti == _frac:
                    for s in _frac_slots:
                        if _type(_member_get(s, o, t)) is not _int:
                            return False
                    continue
                elif _inert(t):
                    d = _getattr(o, "__dict__")
                    if _type(d) is not _dict:
                        return False
                    for kv in _items(d):  # keys too: a key of the program could answer a lookup
                        stack.extend(kv)
                    continue
                else:
                    return False
                for i, desc in _inst_dicts:
                    if i == ti:
                        d = _getset_get(desc, o, t)
                        if _type(d) is not _dict or _len(d):
                            return False
            if visited is not None:
                for o in visited:
                    _cset(_cache, _id(o), o)  # kept alive by the cache: an id there cannot be reused
            return True
        except BaseException:
            return False

    modules = _tuple((name, _sys.modules[name]) for name in restored if name in _sys.modules)
    snaps = _tuple((live, _tuple(saved.items())) for live, saved in
                   ((m.__dict__, _dict(m.__dict__)) for _, m in modules))

    def untouched(_modules=modules, _snaps=snaps, _mutable=_tuple(mutable), _sysmods=_sys.modules,
                  _get=dict.get, _pget=types.MappingProxyType.get, _tdict=tdict_of, _len=len, _missing=object()):
        """The stdlib the tests use is as it was before the program ran: restored modules (attributes and
        ``sys.modules`` entries) and the class dicts of the mutable allowlisted types."""
        for name, m in _modules:
            if _get(_sysmods, name) is not m:
                return False
        for live, items in _snaps:
            for k, v in items:
                if _get(live, k, _missing) is not v:
                    return False
        for c, items in _mutable:
            d = _tdict(c)
            if _len(d) != _len(items):
                return False
            for k, v in items:
                if _pget(d, k, _missing) is not v:
                    return False
        return True

    held, alive, verified = [], [], {}

    class ProgramThreadAlive(BaseException):  # a thread of the program outlived the call (module docstring)
        pass

    def call_checked(__lrl_f, *args, __lrl_plain=plain, __lrl_untouched=untouched, __lrl_held=held,
                     __lrl_alive=alive, __lrl_np=NonPlainResult, __lrl_type=_type, __lrl_id=_id,
                     __lrl_iters=_frozenset(_id(t) for t in iterators), __lrl_list=list, __lrl_iter=iter,
                     __lrl_islice=itertools.islice, __lrl_limit=PLAIN_LIMIT, __lrl_len=len, __lrl_tuple=_tuple,
                     __lrl_gc=(gc.enable, gc.disable), __lrl_quiet=quiet, __lrl_thread=ProgramThreadAlive,
                     __lrl_verified=verified, __lrl_clear=dict.clear,
                     __lrl_scalars=_frozenset(_id(t) for t in scalars), **kw):
        """Call ``f`` for a test; return its result only if no thread of the program is left, the result is
        PLAIN (an iterator of an allowlisted type is drained first, at most ``PLAIN_LIMIT`` items, and
        handed on as an iterator over a checked list), the plain arguments are still plain, earlier checked
        values of this test (``held``) are still plain, and the stdlib is `untouched`; else raise
        ``ProgramThreadAlive`` / ``NonPlainResult``."""
        enable, disable = __lrl_gc
        pre = [a for a in args if __lrl_plain(a)]
        pre += [v for v in kw.values() if __lrl_plain(v)]
        __lrl_alive.append((args, kw))  # nothing the test passed dies (weakref callbacks) before it compares
        __lrl_clear(__lrl_verified)  # the program may change them now: walk them again after the call
        enable()
        r = __lrl_f(*args, **kw)
        disable()  # no collection, hence no finalizer of the program, between the check and the comparison
        lazy = __lrl_id(__lrl_type(r)) in __lrl_iters
        if lazy:
            items = __lrl_list(__lrl_islice(r, __lrl_limit + 1))
            disable()
            if __lrl_len(items) > __lrl_limit:
                raise __lrl_np("an iterator of more than %d items" % __lrl_limit)
            r = items
        if not __lrl_quiet(1):  # before any check: nothing of the program may run beside what follows
            raise __lrl_thread("a thread of the program is still running after the call returned")
        v = __lrl_verified
        if not __lrl_plain(r, _cache=v):
            raise __lrl_np("the result is not a plain value (exact builtin/stdlib value types only)")
        if not __lrl_plain(__lrl_tuple(pre), _cache=v):
            raise __lrl_np("an argument was given a value that is not plain")
        if not __lrl_plain(__lrl_tuple(__lrl_held), _limit=5 * __lrl_limit, _cache=v):  # shared objects once
            raise __lrl_np("an earlier result was changed into a value that is not plain")
        if not __lrl_untouched():
            raise __lrl_np("the program changed the stdlib the tests use")
        for x in pre:
            if __lrl_id(__lrl_type(x)) not in __lrl_scalars:  # a scalar cannot be changed: no need to walk it again
                __lrl_held.append(x)
        if __lrl_id(__lrl_type(r)) not in __lrl_scalars:
            __lrl_held.append(r)
        return __lrl_iter(r) if lazy else r

    method_t = types.MethodType
    # descriptor types whose ``__get__`` is C code (no program code runs when a lookup meets them)
    c_descriptors = _frozenset(_id(t) for t in (
        types.FunctionType, staticmethod, types.GetSetDescriptorType, types.MemberDescriptorType,
        types.WrapperDescriptorType, types.MethodDescriptorType, types.ClassMethodDescriptorType,
        types.BuiltinFunctionType))

    def getattr_checked(obj, name, _call=call_checked, _plain=plain, _inert=inert, _held=held, _type=_type,
                        _id=_id, _typetype=type, _method=method_t,
                        _mfunc=method_t.__dict__["__func__"].__get__, _mself=method_t.__dict__["__self__"].__get__,
                        _flags=flags_of, _mro=mro_of, _tdict=tdict_of, _pget=types.MappingProxyType.get,
                        _get=getattr, _callable=callable, _np=NonPlainResult, _c=c_descriptors,
                        _cm=classmethod, _cmfunc=classmethod.__dict__["__func__"].__get__,
                        _function=types.FunctionType, _builtin=types.BuiltinFunctionType, _str=str,
                        _missing=object(), _heap=_HEAPTYPE, _verified=verified, _dict=dict,
                        _getattr=object.__getattribute__,
                        _scalars=_frozenset(_id(t) for t in scalars)):
        """``obj.name`` for a test (module docstring, ATTRIBUTES): the builtin lookup for anything but a
        program object; for a program object a plain value, a callable wrapped by ``call_checked``, or
        ``NonPlainResult``; a lookup that may run program code runs checked."""
        t = _type(obj)
        if t is _method and _mfunc(obj, t) is _call:  # a wrapped callable: the attributes of what it wraps
            obj = _mself(obj, t)
            t = _type(obj)
        elif not (_flags(obj) & _heap and _inert(obj) if t is _typetype else _flags(t) & _heap and _inert(t)):
            return _get(obj, name)
        if _type(name) is not _str:
            return _get(obj, name)  # TypeError
        if t is _typetype and _flags(obj) & _heap and _inert(obj):  # type's own descriptors (C), then the MRO
            mro, d = _mro(obj), None  # (an inert class: its dicts have exact str keys)
        elif t is _typetype and not _flags(obj) & _heap:  # a builtin class (``int.from_bytes``)
            mro, d = (), None
        elif t is _function:
            mro, d = (), _getattr(obj, "__dict__")
        elif t is _builtin:
            mro, d = (), None
        elif _flags(t) & _heap and _inert(t):  # an inert instance: no __getattribute__/__getattr__ of its own
            mro, d = _mro(t), _getattr(obj, "__dict__")
        else:  # a callable instance, a partial, a class with a metaclass or dunders: may run program code
            return _call(_get, obj, name)
        if d is not None:
            if _type(d) is not _dict:
                return _call(_get, obj, name)
            for k in d:  # a key of the program (its own __eq__) would run in the dict lookup
                if _type(k) is not _str:
                    return _call(_get, obj, name)
        for c in mro:
            found = _pget(_tdict(c), name, _missing)
            if found is _missing:
                continue
            ft = _type(found)
            if _id(ft) in _c:
                break
            if ft is _cm:
                if _type(_cmfunc(found, ft)) is _function:
                    break
                return _call(_get, obj, name)
            if _flags(ft) & _heap:  # an object of a class created at run time (a descriptor of the program...)
                return _call(_get, obj, name)
            for k in _mro(ft):  # a builtin type: ``property`` has a ``__get__``, ``int`` or ``type`` have none
                if _pget(_tdict(k), "__get__", _missing) is not _missing:
                    return _call(_get, obj, name)
            break
        r = _get(obj, name)  # no program code runs in this lookup
        if _plain(r, _cache=_verified):
            if _id(_type(r)) not in _scalars:
                _held.append(r)
            return r
        if _callable(r):
            return _method(_call, r)
        raise _np("attribute %r of a program object is not a plain value" % (name,))

    def getattr_for_tests(obj, name, *default, _g=getattr_checked, _ae=AttributeError):
        """The tests' ``getattr``: attribute loads of program objects are checked (``getattr_checked``)."""
        if not default:
            return _g(obj, name)
        try:
            return _g(obj, name)
        except _ae:
            return default[0]

    def hasattr_for_tests(obj, name, _g=getattr_checked, _ae=AttributeError):
        """The tests' ``hasattr`` (a property of the program runs checked)."""
        try:
            _g(obj, name)
        except _ae:
            return False
        return True

    protected = (inert, plain, untouched, call_checked, getattr_checked, getattr_for_tests, hasattr_for_tests,
                 quiet, NonPlainResult, ProgramThreadAlive)
    builtins_for_tests = {"getattr": getattr_for_tests, "hasattr": hasattr_for_tests}
    return (call_checked, getattr_checked, builtins_for_tests, (held, alive, verified),
            _tuple(_id(p) for p in protected), protected)
