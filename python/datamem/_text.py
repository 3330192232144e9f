"""Text rules every command shares. Text from outside (a target's names and
paths, a profile's call sites, argv) made safe to print: the one rule every
command uses before writing to a terminal, a YAML comment or a log line. And
sizes as commands and environment variables take them (parse_size), and as every
command and message writes them (human_bytes, short_bytes). And the
one rule for a path or name inside a command printed for a shell to run
(shell_arg): quoted, so a space, `;`, `$(...)` or a quote in it is part of the
name, never more words or another command.

Escaped: C0 and C1 controls and DEL (terminal escape sequences, line breaks,
including NEL that YAML reads as one), the Unicode line and paragraph separators,
the bidirectional marks and overrides (text that displays in another order than
it reads), and lone surrogates (bytes that were not UTF-8).
"""
import re
import shlex

_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u2028-\u202e\u2066-\u2069"
                          "\ud800-\udfff]")


def _escape(m):
    c = ord(m.group())
    return "\\x%02x" % c if c < 0x100 else "\\u%04x" % c


def printable(text, keep=""):
    """`text` (any object, as str) with every character above written as \\xNN
    (\\uNNNN past 0xff), except those in `keep` (e.g. "\\n\\t" for multi-line
    output the program itself lays out)."""
    text = str(text)
    if keep:
        return _UNPRINTABLE.sub(lambda m: m.group() if m.group() in keep else _escape(m), text)
    return _UNPRINTABLE.sub(_escape, text)


def shell_arg(text):
    """`text` as one word of a POSIX shell command line (shlex.quote), its
    unprintable characters escaped first (printable()): a command we print is
    pasted into a terminal or a script, so a name with a line break would end it
    early. Such a name is then not the same name, but the command stays one
    harmless command."""
    return shlex.quote(printable(text))


def shell_command(*words):
    """Words joined into one shell command line, each one quoted (shell_arg)."""
    return " ".join(shell_arg(w) for w in words)


_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12}


def parse_size(text):
    """Bytes from "4096", "64KiB", "1 GB", "1.5GiB" (units as in policies, any
    case; a fraction needs a unit and must come to whole bytes, as in a policy);
    ValueError naming the text otherwise."""
    m = re.fullmatch(r"\s*(\d+)(?:\.(\d{1,12}))?\s*([A-Za-z]*)\s*", text)
    unit = m and m.group(3).lower()
    if not m or unit not in _UNITS or (m.group(2) and not unit):
        raise ValueError(
            "bad size %r (bytes, or a number with B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)" % text)
    frac = m.group(2) or ""
    scaled = int(m.group(1) + frac) * _UNITS[unit]
    if scaled % 10 ** len(frac):
        raise ValueError("bad size %r: not a whole number of bytes" % text)
    return scaled // 10 ** len(frac)


def human_bytes(n, b="B"):
    """1536 -> "1.5 KiB", 8 -> "8 B" (or "8 bytes" with b="bytes", as the C
    side's refusal line says it): the one way sizes are written."""
    n = float(n)
    for unit in (b, "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return ("%d %s" % (n, unit)) if unit == b else ("%.1f %s" % (n, unit))
        n /= 1024
    return "%.1f TiB" % n


def short_bytes(n):
    """1536 -> "1.5KiB": at most 9 characters up to 1023.9 TiB (table cells)."""
    return human_bytes(n).replace(" ", "")
