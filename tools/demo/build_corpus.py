"""Build the demo model's training corpus from installed Debian packages (deterministic).

Sources (install them first, see models/demo/README.md):

    apt-get install fortunes fortunes-min fortunes-it fortunes-de fortunes-es fortunes-zh python3-doc

* fortune files: every regular file a package installs under /usr/share/games/fortunes (``.dat``
  index files, symlinks, ASCII-art collections and offensive ``off/`` sections excluded), split into
  fortunes at lines consisting of ``%``; ANSI colour codes and backspace overstriking removed.
* the Python documentation (python3-doc, which depends on python3.X-doc): the HTML pages of the
  tutorial, library, language reference, HOWTOs, FAQ, glossary and "using"/"installing" guides,
  turned to text with the standard library's ``html.parser``; each section (heading) is a document.

Every document goes to the held-out split when the first 8 bytes of sha256(text), as an integer,
modulo 10000 are below ``--heldout-permyriad`` (default 200 = 2 %). A deterministic subset of the
documents is also written as ChatML dialogues from fixed templates (a fortune on request, in the
fortune's language; a documentation section when asked about its topic; a few greetings), in the
same split as the document they come from.

Output (``--out``, default /work/demo_train/corpus): ``train.jsonl``, ``heldout.jsonl`` (one
``{"text", "source", "lang", "kind"}`` per line, kind "text" or "chat"; chat texts are already
rendered with the chat template) and ``manifest.json`` (package versions, file list, counts,
sha256 of both splits).
"""
from __future__ import annotations

import argparse
import hashlib
import html.parser
import json
import os
import re
import subprocess
import sys

FORTUNE_PACKAGES = {
    # package: language
    "fortunes": "en",
    "fortunes-min": "en",
    "fortunes-it": "it",
    "fortunes-de": "de",
    "fortunes-es": "es",
    "fortunes-zh": "zh",
}
DOC_PACKAGE = "python3-doc"
FORTUNE_ROOT = "/usr/share/games/fortunes/"
# Collections of ASCII art / banners (not language) and the offensive sections. `art` is in fact
# quotations about the arts (465 fortunes), excluded by mistake; the shipped demo model was trained
# without it, so it stays excluded here to keep the recipe reproducing that model.
FORTUNE_SKIP = re.compile(r"(^|/)(ascii-art|asciiart|banner|art)$|/off/")
DOC_DIRS = ("tutorial/", "library/", "reference/", "howto/", "faq/", "using/", "installing/")
DOC_FILES = ("glossary.html",)

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
OVERSTRIKE = re.compile(r".\x08")
MAX_FORTUNE_CHARS = 2000
MAX_DOC_CHARS = 4000


def sha_int(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def pkg_version(pkg: str) -> str:
    return subprocess.run(
        ["dpkg-query", "-W", "-f=${Version}", pkg], check=True, capture_output=True, text=True
    ).stdout.strip()


def pkg_files(pkg: str) -> list[str]:
    out = subprocess.run(["dpkg", "-L", pkg], check=True, capture_output=True, text=True).stdout
    return sorted(set(line.strip() for line in out.splitlines() if line.strip()))


def read_text(path: str) -> str:
    data = open(path, "rb").read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def clean(text: str) -> str:
    text = ANSI.sub("", text)
    while "\x08" in text:
        new = OVERSTRIKE.sub("", text)
        if new == text:
            text = text.replace("\x08", "")
            break
        text = new
    text = text.replace("\r\n", "\n").replace("\t", "    ")
    text = "".join(c for c in text if c == "\n" or c >= " " or c == "\t")
    lines = [line.rstrip() for line in text.split("\n")]
    return "\n".join(lines).strip("\n")


# ----------------------------------------------------------------------------- fortunes


def fortune_docs(pkg: str, lang: str) -> tuple[list[dict], list[str]]:
    docs, files = [], []
    for path in pkg_files(pkg):
        if not path.startswith(FORTUNE_ROOT) or os.path.islink(path) or not os.path.isfile(path):
            continue
        rel = path[len(FORTUNE_ROOT):]
        if rel.endswith((".dat", ".u8")) or FORTUNE_SKIP.search("/" + rel):
            continue
        files.append(path)
        chunks = re.split(r"\n%\n", "\n" + read_text(path).replace("\r\n", "\n") + "\n")
        for chunk in chunks:
            text = clean(chunk)
            if len(text) < 10 or len(text) > MAX_FORTUNE_CHARS:
                continue
            docs.append({"text": text, "source": f"{pkg}:{rel}", "lang": lang, "kind": "text"})
    return docs, files


# ----------------------------------------------------------------------------- python docs

BLOCK = {"p", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd", "blockquote", "tr",
         "div", "section", "table", "ul", "ol", "dl", "caption", "figcaption"}
HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}


class DocPage(html.parser.HTMLParser):
    """Sections of a Sphinx page's ``div.body``: a list of (title, [blocks])."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.depth = 0  # div depth inside the body; 0 = outside
        self.skip = 0  # inside script/style/headerlink
        self.pre = 0
        self.heading = None
        self.buf: list[str] = []
        self.sections: list[tuple[str, list[str]]] = []

    def flush(self):
        text = "".join(self.buf)
        self.buf = []
        if self.pre:
            text = text.strip("\n")
        else:
            text = " ".join(text.split())
        if not text:
            return
        if self.heading is not None:
            self.sections.append((text, []))
        elif self.sections:
            self.sections[-1][1].append(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if self.depth == 0:
            if tag == "div" and attrs.get("role") == "main":
                self.depth = 1
            return
        if tag == "div":
            self.depth += 1
        if tag in ("script", "style") or (tag == "a" and "headerlink" in (attrs.get("class") or "")):
            self.skip += 1
            return
        if tag in BLOCK:
            self.flush()
            if tag == "pre":
                self.pre += 1
            if tag in HEADINGS:
                self.heading = tag
        elif tag == "br":
            self.buf.append("\n" if self.pre else " ")

    def handle_endtag(self, tag):
        if self.depth == 0:
            return
        if tag in ("script", "style") or (tag == "a" and self.skip):
            self.skip = max(0, self.skip - 1)
            return
        if tag in BLOCK:
            self.flush()
            if tag == "pre":
                self.pre = max(0, self.pre - 1)
            if tag in HEADINGS:
                self.heading = None
        if tag == "div":
            self.depth -= 1

    def handle_data(self, data):
        if self.depth and not self.skip:
            self.buf.append(data)


def doc_docs(pkg: str) -> tuple[list[dict], list[str]]:
    # python3-doc only depends on python3.X-doc, which holds the files.
    deps = subprocess.run(["dpkg-query", "-W", "-f=${Depends}", pkg], check=True,
                          capture_output=True, text=True).stdout
    holders = sorted(set(re.findall(r"(python3\.\d+-doc)", deps))) or [pkg]
    docs, files = [], []
    for holder in holders:
        for path in pkg_files(holder):
            m = re.search(r"/html/(.*\.html)$", path)
            if not m or not os.path.isfile(path):
                continue
            rel = m.group(1)
            if not (rel.startswith(DOC_DIRS) or rel in DOC_FILES):
                continue
            files.append(path)
            parser = DocPage()
            parser.feed(read_text(path))
            parser.close()
            page_title = parser.sections[0][0] if parser.sections else rel
            for title, blocks in parser.sections:
                body = "\n\n".join(b for b in blocks)
                if len(body) < 80:
                    continue
                # long sections become several documents, cut at paragraph boundaries
                chunks, cur = [], ""
                for block in blocks:
                    if cur and len(cur) + len(block) > MAX_DOC_CHARS:
                        chunks.append(cur)
                        cur = ""
                    cur = f"{cur}\n\n{block}" if cur else block[:MAX_DOC_CHARS]
                chunks.append(cur)
                for i, chunk in enumerate(chunks):
                    text = clean(f"{title}\n\n{chunk}")
                    doc = {"text": text, "source": f"{holder}:{rel}", "lang": "en", "kind": "text"}
                    if i == 0:  # the section's first paragraph answers questions about its title
                        doc.update(title=title, page=page_title, first=clean(blocks[0]))
                    docs.append(doc)
    return docs, files


# ----------------------------------------------------------------------------- dialogues

SYSTEM = "You are Colibri, a small demo model trained on fortune cookies and the Python documentation."
ASK_FORTUNE = {
    "en": ["Tell me a fortune", "Tell me a fortune.", "Give me a fortune cookie.", "Say something wise.",
           "Tell me a quote.", "I need a fortune.", "Got a fortune for me?"],
    "it": ["Dimmi qualcosa", "Dimmi qualcosa.", "Dimmi una frase.", "Raccontami qualcosa.",
           "Dammi un biscotto della fortuna."],
    "de": ["Erzähl mir etwas.", "Sag mir einen Spruch.", "Gib mir einen Glückskeks.", "Sag etwas Kluges."],
    "es": ["Dime algo.", "Dime una frase.", "Cuéntame algo.", "Dame una galleta de la fortuna."],
    "zh": ["给我一句诗", "讲一句话", "给我一个幸运饼干", "说点什么吧"],
}
ASK_DOC = ["What does the Python documentation say about {t}?", "What do the Python docs say about {t}?",
           "Explain {t}.", "Tell me about {t} in Python.", "What is {t}?"]
GREETINGS = [
    ("Hello!", "Hello! I am Colibri, a small demo model. Ask me for a fortune, or about Python."),
    ("Hi", "Hi! I am a tiny mixture-of-experts model. I know fortune cookies and the Python docs."),
    ("Who are you?", "I am Colibri, a small demo model trained on fortune cookies and the Python documentation."),
    ("Ciao!", "Ciao! Sono Colibri, un piccolo modello dimostrativo. Chiedimi una frase."),
    ("Hallo!", "Hallo! Ich bin Colibri, ein kleines Demo-Modell. Frag mich nach einem Spruch."),
    ("¡Hola!", "¡Hola! Soy Colibri, un pequeño modelo de demostración. Pídeme una frase."),
    ("你好", "你好！我是 Colibri，一个小小的演示模型。"),
]


def chatml(messages: list[tuple[str, str]]) -> str:
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)


def dialogues(doc: dict, h: int) -> list[dict]:
    """Zero or one dialogue for a document, chosen by its hash (about 1 in 3 documents)."""
    if (h >> 20) % 3:
        return []
    pick = h >> 24
    system = [("system", SYSTEM)] if (pick % 5) == 0 else []
    if "title" in doc:  # a documentation section
        topic = re.sub(r"^[\d.]+\s+", "", doc["title"]).strip()
        answer = doc["first"]
        if len(answer) < 40 or len(topic) > 80:
            return []
        if len(answer) > 800:
            answer = answer[: answer.rfind(" ", 0, 800)] + " ..."
        q = ASK_DOC[(pick >> 4) % len(ASK_DOC)].format(t=topic)
    else:
        if len(doc["text"]) > 800:
            return []
        asks = ASK_FORTUNE[doc["lang"]]
        q, answer = asks[(pick >> 4) % len(asks)], doc["text"]
    msgs = system + [("user", q), ("assistant", answer)]
    return [{"text": chatml(msgs), "source": doc["source"], "lang": doc["lang"], "kind": "chat"}]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/work/demo_train/corpus")
    ap.add_argument("--heldout-permyriad", type=int, default=200)
    args = ap.parse_args(argv)

    manifest = {"packages": {}, "files": [], "counts": {}}
    docs = []
    for pkg, lang in FORTUNE_PACKAGES.items():
        d, files = fortune_docs(pkg, lang)
        manifest["packages"][pkg] = pkg_version(pkg)
        manifest["files"] += files
        docs += d
    d, files = doc_docs(DOC_PACKAGE)
    manifest["packages"][DOC_PACKAGE] = pkg_version(DOC_PACKAGE)
    for holder in sorted({f.split("/")[4] for f in files}):
        manifest["packages"][holder + "-doc"] = pkg_version(holder + "-doc")
    manifest["files"] += files
    docs += d

    seen = set()
    splits = {"train": [], "heldout": []}
    for doc in docs:
        if doc["text"] in seen:
            continue
        seen.add(doc["text"])
        h = sha_int(doc["text"])
        split = "heldout" if h % 10000 < args.heldout_permyriad else "train"
        chats = dialogues(doc, h)
        for key in ("title", "page", "first"):
            doc.pop(key, None)
        splits[split].append(doc)
        splits[split] += chats
    # greetings: always in train (they are fixed strings), once per variant with/without system
    for i, (q, a) in enumerate(GREETINGS):
        for system in ([], [("system", SYSTEM)]):
            splits["train"].append({"text": chatml(system + [("user", q), ("assistant", a)]),
                                    "source": "template", "lang": "xx", "kind": "chat"})

    os.makedirs(args.out, exist_ok=True)
    for name, rows in splits.items():
        path = os.path.join(args.out, f"{name}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        manifest[f"{name}_sha256"] = hashlib.sha256(open(path, "rb").read()).hexdigest()
        counts = {}
        for row in rows:
            key = f"{row['kind']}:{row['lang']}"
            c = counts.setdefault(key, [0, 0])
            c[0] += 1
            c[1] += len(row["text"])
        manifest["counts"][name] = {k: {"docs": v[0], "chars": v[1]} for k, v in sorted(counts.items())}
    with open(os.path.join(args.out, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, ensure_ascii=False)
    for name in splits:
        tot = sum(v["chars"] for v in manifest["counts"][name].values())
        print(f"{name}: {len(splits[name])} docs, {tot} chars", file=sys.stderr)
        for k, v in manifest["counts"][name].items():
            print(f"  {k:10s} {v['docs']:7d} docs {v['chars']:10d} chars", file=sys.stderr)


if __name__ == "__main__":
    main()
