"""Griffe extension (mkdocs.yml): the docstrings' Sphinx markup as the API reference's Markdown.

fedbayes' docstrings are read by ``help()`` and in editors as well as on the site, and they use
Sphinx's roles. On the site, when the package is loaded:

* a role (``:class:`X```, ``:func:``, ``:meth:``, ``:mod:``, ``:attr:``, ``:data:``, ``:obj:``,
  ``:exc:``) becomes a cross-reference: a link where the object is on the site, its name in code
  where it is not. A relative name (``:meth:`run_round```) is resolved in the docstring's scope,
  as Python would; ``~`` shows the last part of the name only, as in Sphinx;
* a literal block introduced by ``::`` (``Example::`` and its indented lines) becomes a fenced
  Python code block.
"""

from __future__ import annotations

import re
import textwrap

import griffe

ROLES = ("class", "func", "meth", "mod", "attr", "data", "obj", "exc")
ROLE = re.compile(r":(?:py:)?(?:" + "|".join(ROLES) + r"):`(~?)([\w.]+)(\(\))?`")
LITERAL = re.compile(r"^(?P<indent>[ \t]*)(?P<lead>\S[^\n]*?)::[ \t]*\n\n(?P<body>(?:(?P=indent)[ \t]+[^\n]*\n|[ \t]*\n)+)", re.M)


def _target(obj: griffe.Object, name: str) -> str:
    """The full path of ``name`` as written in ``obj``'s docstring (its first part resolved in
    ``obj``'s scope, then its parents'); ``name`` itself where it does not resolve."""
    if name.startswith("fedbayes."):
        return name
    head, _, rest = name.partition(".")
    try:
        path = obj.resolve(head)
    except (griffe.NameResolutionError, griffe.AliasResolutionError, KeyError, AttributeError):
        return name
    return f"{path}.{rest}" if rest else path


def roles_to_refs(text: str, obj: griffe.Object) -> str:
    """Every Sphinx role of ``text`` as an optional cross-reference (a link if the site has the object)."""

    def ref(match: re.Match) -> str:
        tilde, name, parens = match.group(1), match.group(2), match.group(3) or ""
        title = (name.rsplit(".", 1)[-1] if tilde else name) + parens
        return f'<autoref identifier="{_target(obj, name)}" optional><code>{title}</code></autoref>'

    return ROLE.sub(ref, text)


def literal_blocks_to_fences(text: str) -> str:
    """``Lead::`` + a blank line + an indented block as ``Lead:`` + a fenced Python block."""

    def fence(match: re.Match) -> str:
        indent, lead = match.group("indent"), match.group("lead")
        body = textwrap.dedent(match.group("body")).strip("\n")
        code = textwrap.indent(f"```python\n{body}\n```", indent)
        return f"{indent}{lead}:\n\n{code}\n\n"

    return LITERAL.sub(fence, text)


def _objects(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member)


class ReSTRoles(griffe.Extension):
    """Rewrites every docstring of a loaded package (roles, literal blocks) before it is parsed."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        for obj in _objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = roles_to_refs(literal_blocks_to_fences(obj.docstring.value), obj)
