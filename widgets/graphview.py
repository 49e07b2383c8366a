"""What the graph picture shows: nodes grouped by module, expandable to ops, laid out top-down.

The view starts with the model's top-level modules (runs of consecutive ops in topological
order that belong to the same module); expanding an item shows its sub-modules, and at the
bottom its ops. Items with too many children are shown in blocks, so even a 100,000-op graph
draws a few hundred items at a time. Parameters, buffers and inputs travel with the op that
first uses them (:meth:`explorer.OpGraph.owner`).

Items are laid out top to bottom in rows by dependency, with edges routed between them
(:mod:`widgets.layout`); the expanded modules are drawn as frames around their items.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph
from widgets.layout import Layout, layered_layout

#: most items an expanded item shows before its children are grouped into blocks
MAX_CHILDREN = 120


@dataclass(frozen=True)
class Frame:
    """An expanded module (or block) drawn around the items it shows."""

    key: str
    label: str
    nest: int  # how many frames it is in
    members: tuple[int, ...]  # positions of its items


@dataclass(frozen=True)
class Item:
    """One drawn node: a module run, a block of ops, or a single op."""

    key: str
    label: str
    nodes: tuple[int, ...]  # graph indices: ops and the parameters/inputs they own
    ops: tuple[int, ...]
    depth: int
    expandable: bool
    kind: str  # "module" | "block" | "op"


def name_in_key(key: str) -> str:
    """The op name or module path an item's key ends with ("" for a block or a run of loose
    ops): what finds the item again once other items are shown."""
    last = key.rsplit("/", 1)[-1]
    if last.startswith("op:"):
        return last[3:]
    if last.startswith("m:") and not last.startswith("m:ops@"):
        return last[2:].rsplit("@", 1)[0]
    return ""


class GraphView:
    """The items currently shown for ``graph``, given which items are expanded."""

    def __init__(self, graph: OpGraph) -> None:
        self.graph = graph
        self.expanded: set[str] = set()
        self._owned: dict[int, list[int]] = defaultdict(list)
        orphans = []
        for i, n in enumerate(graph.nodes):
            if n.kind != "op":
                o = graph.owner(i)
                (orphans if o == i else self._owned[o]).append(i)
        self._ops = [i for i, n in enumerate(graph.nodes) if n.kind == "op"]
        if orphans and self._ops:
            self._owned[self._ops[0]][:0] = orphans
        self._paths = {i: graph.nodes[i].module_path.split(".") if graph.nodes[i].module_path
                       else [] for i in self._ops}
        self.items: list[Item] = []
        self.refresh()

    # -- structure -----------------------------------------------------------------------
    def refresh(self) -> None:
        """Recompute the shown items from ``expanded``."""
        items: list[Item] = []
        self._children_of(tuple(self._ops), 0, "", items)
        self.items = items
        self.item_of = {}
        for k, it in enumerate(items):
            for i in it.nodes:
                self.item_of[i] = k

    def expand(self, keys: list[str]) -> None:
        self.expanded.update(k for k in keys if self._find(k) and self._find(k).expandable)
        self.refresh()

    def collapse(self, keys: list[str]) -> None:
        """Collapse the items' parents (for an op or sub-module, the module it is in)."""
        for k in keys:
            for parent in list(self.expanded):
                if k.startswith(parent + "/") or k == parent:
                    self.expanded.discard(parent)
        self.refresh()

    def collapse_all(self) -> None:
        self.expanded.clear()
        self.refresh()

    def expand_all(self) -> None:
        """Expand everything (every op its own item): meant for small graphs."""
        for _ in range(64):
            more = {it.key for it in self.items if it.expandable} - self.expanded
            if not more:
                break
            self.expanded |= more
            self.refresh()

    def expand_to(self, depth: int) -> None:
        """Show modules down to ``depth`` parts of their path (and no deeper)."""
        self.expanded.clear()
        self.refresh()
        for _ in range(64):
            more = {it.key for it in self.items
                    if it.expandable and it.depth + 1 < depth} - self.expanded
            if not more:
                break
            self.expanded |= more
            self.refresh()

    def names_to_find(self) -> list[str]:
        """Every module path (and its parents) and op name of the graph, modules first: what
        the find box suggests."""
        return list(self._kinds())

    def _kinds(self) -> dict[str, str]:
        """Name -> what it is (a module's class, an op's operator), modules first."""
        g = self.graph
        types: dict[str, str] = {}
        for i, p in self._paths.items():
            for k in range(1, len(p) + 1):
                types.setdefault(".".join(p[:k]), "")
            if p:
                types[".".join(p)] = types[".".join(p)] or g.nodes[i].module_type
        out = dict(sorted(types.items()))
        out.update((g.nodes[i].name, g.nodes[i].op) for i in self._ops)
        return out

    def search(self, query: str, limit: int = 64) -> list[str]:
        """Module paths and op names that ``query`` names, best kind of match first: the
        exact name; names with ``query`` as whole path parts ("h.3" in "m.h.3.attn", not
        "m.h.30"); names, module classes or operators containing it ("attention" finds
        the CausalSelfAttention modules); names holding its characters in order. Of the
        modules matched, only the outermost (not those inside another match) are kept."""
        q = query.strip().lower()
        if not q:
            return []
        kinds = self._kinds()
        if query.strip() in kinds:
            return [query.strip()]
        whole = re.compile(rf"(^|[._/]){re.escape(q)}($|[._/])")
        fuzzy = re.compile(".*?".join(map(re.escape, q)))
        for test in (lambda n, _k: whole.search(n), lambda n, k: q in n or q in k,
                     lambda n, _k: fuzzy.search(n)):
            hits = [n for n, k in kinds.items() if test(n.lower(), k.lower())]
            hit = set(hits)
            outer = [n for n in hits if not any(
                ".".join(n.split(".")[:k]) in hit for k in range(1, n.count(".") + 1))]
            if outer:
                return outer[:limit]
        return []

    def label_of(self, k: int) -> str:
        """Item ``k``'s name without the module class ("blocks.0", not "blocks.0 (Block)")."""
        return self.items[k].label.split(" (")[0]

    def matching(self, name: str) -> list[int]:
        """Positions of the shown items that are ``name``: by key, by label, or the one op."""
        return [k for k, it in enumerate(self.items)
                if it.key == name or self.label_of(k) == name
                or (len(it.ops) == 1 and self.graph.nodes[it.ops[0]].name == name)]

    def reveal(self, name: str) -> list[int]:
        """Positions of the items that show node or module ``name``, expanding the folded
        modules it is in as far as needed; [] when the graph has no such node or module."""
        g = self.graph
        want = {i for i in self._ops
                if g.nodes[i].name == name or g.nodes[i].module_path == name
                or g.nodes[i].module_path.startswith(name + ".")}
        want |= {o for o, owned in self._owned.items()  # a parameter: the op that owns it
                 if any(g.nodes[j].name == name for j in owned)}
        if not want:
            return []
        for _ in range(64):
            shown = sorted({self.item_of[i] for i in want if i in self.item_of})
            # items holding other nodes too: open them (unless one is the module itself)
            mixed = [k for k in shown if not set(self.items[k].ops) <= want
                     and self.label_of(k) != name]
            opened = [self.items[k].key for k in mixed if self.items[k].expandable]
            if not mixed or not opened:
                return shown
            self.expanded.update(opened)
            self.refresh()
        return sorted({self.item_of[i] for i in want if i in self.item_of})

    def find(self, names_or_keys: list[str]) -> list[int]:
        """Positions of the items that are or show each node name, module path or item key,
        expanding folded modules as far as needed (as clicking a search result does).

        Raises :class:`explorer.ExplorerError` naming what the graph does not have (the view
        may have opened modules for the names it did find)."""
        want = list(dict.fromkeys(names_or_keys))
        idx: set[int] = set()
        unknown: list[str] = []
        for _ in range(16):  # until a pass over every name opens nothing more
            before = [it.key for it in self.items]
            idx, unknown = set(), []
            for w in want:
                hits = self.matching(w) or self.reveal(w)
                if not hits:
                    unknown.append(w)
                idx.update(hits)
            if [it.key for it in self.items] == before:
                break
        if unknown:
            raise ExplorerError(f"no node or module named {', '.join(map(repr, unknown))} "
                                "in this graph (names as in the hover text, e.g. "
                                "'blocks.0' or 'linear_1')")
        return sorted(idx)

    def _find(self, key: str) -> Item | None:
        return next((it for it in self.items if it.key == key), None)

    def names(self, keys_or_indices) -> list[str]:
        """Graph node names (ops and what they own) of shown items, by key or position."""
        out = []
        for k in keys_or_indices:
            it = self.items[k] if isinstance(k, int) else self._find(k)
            if it is not None:
                out.extend(self.graph.nodes[i].name for i in it.nodes)
        return out

    def _with_owned(self, ops: tuple[int, ...]) -> tuple[int, ...]:
        out = []
        for i in ops:
            out.extend(self._owned.get(i, ()))
            out.append(i)
        return tuple(out)

    def _children_of(self, ops: tuple[int, ...], depth: int, parent: str,
                     out: list[Item]) -> None:
        groups = self._split(ops, depth)
        while len(groups) == 1 and groups[0][0] is not None and depth < 64:
            depth += 1  # one module only at this depth: look one level deeper
            groups = self._split(ops, depth)
        if len(groups) == 1 and groups[0][0] is None:  # ops without deeper modules
            groups = [(None, (i,)) for i in ops]
        if len(groups) > MAX_CHILDREN:
            self._blocks(groups, depth, parent, out)
            return
        for path, members in groups:
            self._emit(path, members, depth, parent, out)

    def _emit(self, path, members, depth, parent, out) -> None:
        g = self.graph
        if path is None and len(members) == 1:
            i = members[0]
            out.append(Item(f"{parent}/op:{g.nodes[i].name}", g.nodes[i].name,
                            self._with_owned(members), members, depth, False, "op"))
            return
        if path is not None:
            label = path
        else:  # ops outside any module at this depth (shape arithmetic, the loss, ...)
            first, last = g.nodes[members[0]].name, g.nodes[members[-1]].name
            label = f"{len(members)} ops: {first} .. {last}"
        key = f"{parent}/m:{path or 'ops'}@{members[0]}"
        if key in self.expanded and len(members) > 1:
            self._children_of(members, depth + 1, key, out)
            return
        # the module's class is known for leaf modules (the ops' own module) only
        typ = (g.nodes[members[0]].module_type
               if path is not None and ".".join(self._paths[members[0]]) == path else "")
        text = f"{label} ({typ})" if typ and path else label
        out.append(Item(key, text or "(model)", self._with_owned(members), members, depth,
                        len(members) > 1, "module"))

    def _blocks(self, groups, depth, parent, out) -> None:
        size = -(-len(groups) // MAX_CHILDREN)
        for b in range(0, len(groups), size):
            chunk = groups[b:b + size]
            members = tuple(i for _, m in chunk for i in m)
            if len(chunk) == 1:
                self._emit(chunk[0][0], chunk[0][1], depth, parent, out)
                continue
            key = f"{parent}/b:{members[0]}-{members[-1]}"
            if key in self.expanded:
                for path, m in chunk:
                    self._emit(path, m, depth, key, out)
                continue
            first, last = self.graph.nodes[members[0]].name, self.graph.nodes[members[-1]].name
            out.append(Item(key, f"{len(members)} ops: {first} .. {last}",
                            self._with_owned(members), members, depth, True, "block"))

    def _split(self, ops: tuple[int, ...], depth: int) -> list[tuple[str | None, tuple]]:
        """Consecutive runs of ops by module path cut to ``depth + 1`` parts (None: the op
        has no module that deep)."""
        groups: list[tuple[str | None, list[int]]] = []
        for i in ops:
            p = self._paths[i]
            key = ".".join(p[:depth + 1]) if len(p) > depth else None
            if groups and groups[-1][0] == key and key is not None:
                groups[-1][1].append(i)
            elif groups and key is None and groups[-1][0] is None:
                groups[-1][1].append(i)
            else:
                groups.append((key, [i]))
        return [(k, tuple(m)) for k, m in groups]

    # -- drawing data --------------------------------------------------------------------
    def edges(self) -> dict[tuple[int, int], int]:
        """Bytes flowing between shown items (item position pairs)."""
        out: dict[tuple[int, int], int] = defaultdict(int)
        item_of = self.item_of
        for p, c, b in self.graph.edges:
            a, z = item_of.get(p), item_of.get(c)
            if a is not None and z is not None and a != z:
                out[a, z] += b
        return dict(out)

    def layout(self, edges: dict[tuple[int, int], int] | None = None,
               frames: list[Frame] | None = None) -> Layout:
        """Where the items, edges and frames (``frames``, by default :meth:`frames`; outlines
        in the same order) go: rows by dependency, edges routed between the items, each
        frame's items side by side (:func:`widgets.layout.layered_layout`)."""
        chains: list[tuple[int, ...]] = [()] * len(self.items)
        for f, frame in enumerate(self.frames() if frames is None else frames):
            for k in frame.members:
                chains[k] = (*chains[k], f)
        return layered_layout(len(self.items), self.edges() if edges is None else edges,
                              chains=chains)

    def frames(self) -> list[Frame]:
        """The expanded modules and blocks that have items shown: each is drawn as a frame
        around its items, outermost first (runs of ops outside any module get none)."""
        members: dict[str, list[int]] = defaultdict(list)
        for k, it in enumerate(self.items):
            cut = it.key.find("/", 1)
            while cut > 0:
                members[it.key[:cut]].append(k)
                cut = it.key.find("/", cut + 1)
        out = []
        for key in sorted(members, key=lambda k: (k.count("/"), members[k][0])):
            last = key.rsplit("/", 1)[-1]
            if last.startswith("m:ops@"):
                continue
            if last.startswith("m:"):
                label = last[2:].rsplit("@", 1)[0]
            else:  # a block of consecutive items: its first and last op
                first, end = (self.graph.nodes[int(i)].name for i in last[2:].split("-"))
                label = f"{first} .. {end}"
            out.append(Frame(key, label, key.count("/") - 1, tuple(members[key])))
        return out

