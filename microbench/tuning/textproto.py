"""Protocol buffer text format, read into a tree and written back, fields XLA's proto has that we don't model kept.

Why not the protobuf library: XLA's message classes (xla.gpu.DeviceHloInstructionProfiles and the HLO protos
under it) are not shipped in Python by jaxlib, and a table written by XLA's own generator carries fields this
toolkit never reads (`metadata`, `fingerprint`, `frontend_attributes`); merging into such a table must keep
them byte for byte. A message is a list of (name, value) pairs in file order, a value a scalar's text
(quoted strings keep their quotes) or a nested message (a list).
"""

from __future__ import annotations

import re
from typing import Union

Message = list[tuple[str, Union[str, "Message"]]]

_TOKEN = re.compile(r'\s+|#[^\n]*|("(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\')|([{}<>:;,\[\]])|([^\s{}<>:;,\[\]"\'#]+)')


class TextProtoError(ValueError):
  """Text that is not protocol buffer text format; the message gives the line."""


def _tokens(text: str) -> list[tuple[str, int]]:
  out, pos, line = [], 0, 1
  while pos < len(text):
    m = _TOKEN.match(text, pos)
    if m is None:
      raise TextProtoError(f"line {line}: cannot read {text[pos:pos + 20]!r}")
    tok = m.group(1) or m.group(2) or m.group(3)
    if tok:
      out.append((tok, line))
    line += text.count("\n", pos, m.end())
    pos = m.end()
  return out


def parse(text: str) -> Message:
  """The text's top-level message (TextProtoError with a line number where it is not text format)."""
  toks = _tokens(text)
  msg, i = _message(toks, 0, None)
  return msg


def _message(toks: list[tuple[str, int]], i: int, close: str | None) -> tuple[Message, int]:
  out: Message = []
  while i < len(toks):
    tok, line = toks[i]
    if tok == close:
      return out, i + 1
    if tok in (",", ";"):
      i += 1
      continue
    if not re.match(r"[A-Za-z_\[]", tok):
      raise TextProtoError(f"line {line}: expected a field name, found {tok!r}")
    name, i = tok, i + 1
    if i < len(toks) and toks[i][0] == ":":
      i += 1
    if i >= len(toks):
      raise TextProtoError(f"line {line}: field {name} has no value")
    tok, line = toks[i]
    if tok in ("{", "<"):
      sub, i = _message(toks, i + 1, "}" if tok == "{" else ">")
      out.append((name, sub))
    elif tok == "[":
      raise TextProtoError(f"line {line}: list syntax for {name} is not supported; repeat the field")
    else:
      value, i = tok, i + 1
      while i < len(toks) and toks[i][0][:1] in "\"'" and value[:1] in "\"'":  # adjacent strings concatenate
        value = value[:-1] + toks[i][0][1:]
        i += 1
      out.append((name, value))
  if close is not None:
    raise TextProtoError(f"unclosed message at the end of the text (expected {close!r})")
  return out, i


def render(msg: Message, indent: int = 0) -> str:
  """The message as text format, one field per line, nested messages indented by two."""
  pad = "  " * indent
  lines = []
  for name, value in msg:
    if isinstance(value, list):
      lines.append(f"{pad}{name} {{")
      body = render(value, indent + 1)
      if body:
        lines.append(body)
      lines.append(f"{pad}}}")
    else:
      lines.append(f"{pad}{name}: {value}")
  return "\n".join(lines)


def get(msg: Message, name: str) -> list:
  """Every value of the field `name`, in order."""
  return [v for n, v in msg if n == name]


def first(msg: Message, name: str, default=None):
  found = get(msg, name)
  return found[0] if found else default


def unquote(value: str) -> str:
  return value[1:-1] if value[:1] in "\"'" else value


def quote(text: str) -> str:
  return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
