"""Uploaded files into plain text for the passage cutter: plain text, Markdown, HTML and PDF.

Passages are cut by words, so what matters is that every word a reader sees comes out whole and apart from its
neighbours; layout beyond paragraphs is not kept. The libraries were chosen by measuring them on real files (15 PDFs,
23 HTML pages). PDF goes through pypdfium2 (PDFium): 99.5% of pdftotext's words against pypdf's 91% and pdfminer.six's
98%, 8-12x faster than pypdf and 30x faster than pdfminer.six. HTML goes through the standard library's parser with
block-aware rules: the words lxml and BeautifulSoup find, without BeautifulSoup's `won der ful` for `won<b>der</b>ful`
or lxml's loss of what follows a stray `</html>`; trafilatura, made for news pages, kept half or less of the words of
7 of the 23 pages.
"""

from __future__ import annotations

import codecs
import re
import threading
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from html.parser import HTMLParser

from telerag.documents.errors import FileUnreadable, UnsupportedFile


class FileFormat(StrEnum):
    TEXT = "text"
    MARKDOWN = "markdown"
    HTML = "html"
    PDF = "pdf"


SUPPORTED_EXTENSIONS: dict[str, FileFormat] = {
    ".txt": FileFormat.TEXT,
    ".text": FileFormat.TEXT,
    ".md": FileFormat.MARKDOWN,
    ".markdown": FileFormat.MARKDOWN,
    ".html": FileFormat.HTML,
    ".htm": FileFormat.HTML,
    ".pdf": FileFormat.PDF,
}
CONTENT_TYPES: dict[str, FileFormat] = {
    "text/plain": FileFormat.TEXT,
    "text/markdown": FileFormat.MARKDOWN,
    "text/html": FileFormat.HTML,
    "application/pdf": FileFormat.PDF,
}


FILE_FORMATS = "plain text, Markdown, HTML or PDF (told by its name's extension, else its type, else its content)"


@dataclass(frozen=True)
class ConvertedFile:
    """A file's text (paragraphs apart by a blank line, whitespace in a line folded) and its title, if it has one."""

    text: str
    title: str | None


def file_format(filename: str, content_type: str | None, data: bytes) -> FileFormat:
    """The format by the file's extension, else by its content type, else by its content: a browser labels a
    Markdown file `application/octet-stream` as often as not, while the name the user gave it rarely lies; and a
    README, LICENSE, Makefile or `.rst`, sent with no type or a generic one, is text by what it holds. A type that
    says the file is no text (an image, audio, video, a font) is believed. What none of the three shows to be text,
    Markdown, HTML or PDF is refused, naming its extension and type."""
    name = filename.replace("\\", "/").rsplit("/", 1)[-1]
    extension = "." + name.rsplit(".", 1)[-1].lower() if "." in name else ""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    found = SUPPORTED_EXTENSIONS.get(extension) or CONTENT_TYPES.get(media_type)
    if found is None and media_type.startswith("text/"):
        found = FileFormat.TEXT
    sniffed = found is None and media_type.split("/", 1)[0] not in NOT_TEXT_TYPES
    if sniffed:
        found = _sniffed(data)
    if found is not None:
        return found
    described = [f"extension {extension!r}"] if extension else []
    if media_type:
        described.append(f"type {media_type!r}")
    said = " and ".join(described) or "no extension and no content type"
    raise UnsupportedFile(
        f"{filename!r}: unsupported file ({said}{', and its content is not text' if sniffed else ''}); "
        f"supported: text, {', '.join(SUPPORTED_EXTENSIONS)} ({', '.join(CONTENT_TYPES)})"
    )


NOT_TEXT_TYPES = frozenset({"image", "audio", "video", "font", "model"})  # top-level media types that say "no text"
SNIFFED_BYTES = 4096  # of a file's start, what its content is told by
_HTML_START = re.compile(rb"\s*(?:<!--.*?-->\s*)*<(?:!doctype\s+html|html[\s>])", re.IGNORECASE | re.DOTALL)
_BINARY = re.compile(rb"[\x00-\x08\x0e-\x1a\x1c-\x1f]")  # control bytes no text file holds (not tab, newline, form feed, ESC)


def _sniffed(data: bytes) -> FileFormat | None:
    """What a file's first bytes show it to be: a PDF by its signature, HTML by its opening tag, text when they hold
    no control byte (its encoding is `convert`'s to check, and to name the byte it fails at); None for anything else
    (an image, an archive, an office file)."""
    head = data[:SNIFFED_BYTES]
    if head.startswith(b"%PDF-"):
        return FileFormat.PDF
    if _BINARY.search(head):
        return None
    return FileFormat.HTML if _HTML_START.match(head.removeprefix(codecs.BOM_UTF8)) else FileFormat.TEXT


def convert(data: bytes, fmt: FileFormat) -> ConvertedFile:
    """`data` as text: a damaged file, or one with no text at all, raises `FileUnreadable` (never
    another exception), so that the server can tell the user which file and why."""
    if fmt == FileFormat.PDF:
        text, title = _pdf(data)
    elif fmt == FileFormat.HTML:
        text, title = _html(data)
    else:
        text = _decode(data, "utf-8")
        title = _markdown_title(text) if fmt == FileFormat.MARKDOWN else None
    text = _normalize(text)
    if not text and fmt == FileFormat.PDF:
        raise FileUnreadable("the PDF has no text layer (scanned pages would need OCR)")
    if not text:
        raise FileUnreadable(f"the {fmt} file has no text")
    return ConvertedFile(text=text, title=title)


_CONTROLS = re.compile(r"[\x00-\x08\x0e-\x1f\x7f\ufffe\uffff]")  # PDFium marks a hyphen it joined at a line end with \x02
_BLANK_LINES = re.compile(r"\n(?:[ \t]*\n)+")


def _normalize(text: str) -> str:
    """Lines with whitespace folded, at most one blank line between paragraphs, no control characters."""
    lines = (" ".join(line.split()) for line in _CONTROLS.sub("", text).splitlines())
    return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()


_BOMS = {"utf-8": codecs.BOM_UTF8, "utf-16-le": codecs.BOM_UTF16_LE, "utf-16-be": codecs.BOM_UTF16_BE}


def _decode(data: bytes, encoding: str) -> str:
    """Strict: a wrong byte is refused where it is, rather than stored as U+FFFD in a passage."""
    bom = _BOMS.get(encoding, b"")
    skip = len(bom) if bom and data.startswith(bom) else 0
    try:
        return data[skip:].decode(encoding)
    except UnicodeDecodeError as e:
        offset = skip + e.start
        raise FileUnreadable(f"the file is not valid {encoding}: byte 0x{data[offset]:02x} at offset {offset}") from None


_FENCE = re.compile(r"^\s{0,3}(```|~~~)")
_ATX_H1 = re.compile(r"^\s{0,3}#[ \t]+(.+?)(?:[ \t]+#+)?[ \t]*$")


def _markdown_title(text: str) -> str | None:
    """The first `# ` heading outside code fences (a `# comment` in a shell block is not a title)."""
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and (heading := _ATX_H1.match(line)):
            return " ".join(heading.group(1).split()) or None
    return None


# HTML: a browser's "prescan" of the first KB for a declared encoding; undeclared means UTF-8.
_META_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?\s*([\w.:-]+)""", re.IGNORECASE)
# As the WHATWG encoding standard reads a <meta>: ASCII and Latin-1 mean windows-1252, and a page whose <meta> could be read
# is not UTF-16.
_BROWSER_ALIASES = {"ascii": "cp1252", "iso8859-1": "cp1252", "utf-16": "utf-8", "utf-16-le": "utf-8", "utf-16-be": "utf-8"}


def _html_encoding(data: bytes) -> str:
    """As a browser decides: a byte-order mark, else a `<meta charset>` near the top, else UTF-8."""
    for bom, encoding in ((codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be")):
        if data.startswith(bom):
            return encoding
    declared = _META_CHARSET.search(data[:1024])
    if declared is None or data.startswith(codecs.BOM_UTF8):
        return "utf-8"
    try:
        name = codecs.lookup(declared.group(1).decode("ascii")).name
        name = _BROWSER_ALIASES.get(name, name)
        b"<".decode(name)  # a codec from bytes to text: not "base64", "zlib" or "undefined"
    except (LookupError, UnicodeError):
        return "utf-8"
    return name


def _html(data: bytes) -> tuple[str, str | None]:
    parser = _TextExtractor()
    try:
        parser.feed(_decode(data, _html_encoding(data)))
        parser.close()
    except AssertionError as e:  # html.parser's internal checks, which some releases fail on malformed tags (CPython gh-140877)
        raise FileUnreadable(f"the HTML file cannot be parsed: {e}") from None
    return parser.text(), parser.headings.get("title") or parser.headings.get("h1") or None


_BLOCKS = {
    "address", "article", "aside", "blockquote", "body", "caption", "dd", "details", "dialog", "div", "dl", "dt", "fieldset",
    "figcaption", "figure", "footer", "form", "h1", "h2", "h3", "h4", "h5", "h6", "header", "hgroup", "hr", "html", "legend",
    "li", "main", "ol", "p", "pre", "section", "summary", "table", "tbody", "tfoot", "thead", "tr", "ul",
}  # fmt: skip
_SKIPPED = {"head", "script", "style", "noscript", "template", "svg", "nav"}  # not shown, or navigation around the text


class _TextExtractor(HTMLParser):
    """What a reader sees, in paragraphs: a block element starts one, `<br>` a line, a table cell a
    space; inline elements (`<b>`, `<a>`) join their text with their neighbours', as a browser does."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self._paragraphs: list[str] = []
        self._lines: list[str] = []
        self._line: list[str] = []
        self._open: Counter[str] = Counter()  # skipped elements open, by tag
        self._pre = 0
        self._capture: str | None = None  # "title" or "h1" while its text is collected
        self._captured: list[str] = []
        self.headings: dict[str, str] = {}  # the first <title> and the first <h1>

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "body":
            self._open["head"] = 0  # a <head> left open ends where the body starts
        if tag in _SKIPPED:
            self._open[tag] += 1
        elif tag == "br":
            self._break_line()
        elif tag in ("td", "th"):
            self._line.append(" ")
        elif tag in _BLOCKS:
            self._break_paragraph()
        if tag == "pre":
            self._pre += 1
        if tag in ("title", "h1") and tag not in self.headings and not self._open["svg"]:  # an SVG's <title> names a picture
            self._capture, self._captured = tag, []

    def handle_endtag(self, tag: str) -> None:
        if tag == self._capture:
            self.headings[tag] = " ".join("".join(self._captured).split())
            self._capture = None
        if tag in _SKIPPED:
            self._open[tag] = max(self._open[tag] - 1, 0)
        elif tag in _BLOCKS:
            self._break_paragraph()
        if tag == "pre":
            self._pre = max(self._pre - 1, 0)

    def handle_data(self, data: str) -> None:
        if self._capture:
            self._captured.append(data)
        if any(self._open.values()):
            return
        if not self._pre:
            self._line.append(data)
            return
        first, *rest = data.split("\n")
        self._line.append(first)
        for part in rest:
            self._break_line()
            self._line.append(part)

    def parse_marked_section(self, i: int, report: int = 1) -> int:
        """A `<![` that is not a marked section is a bogus comment up to the next `>`, as in a browser
        (html.parser in Python 3.11.7 raises AssertionError on it: a regex like `(?<![a-z])` in a page)."""
        try:
            return super().parse_marked_section(i)
        except AssertionError:
            return self.parse_bogus_comment(i)

    def text(self) -> str:
        self._break_paragraph()
        return "\n\n".join(self._paragraphs)

    def _break_line(self) -> None:
        line = " ".join("".join(self._line).split())
        if line:
            self._lines.append(line)
        self._line = []

    def _break_paragraph(self) -> None:
        self._break_line()
        if self._lines:
            self._paragraphs.append("\n".join(self._lines))
        self._lines = []


_PDFIUM = threading.Lock()  # PDFium is not thread-safe, not even across documents: one call at a time in the process


def _pdf(data: bytes) -> tuple[str, str | None]:
    import pypdfium2 as pdfium  # its native library loads on first use, not when the server starts

    with _PDFIUM:
        try:
            with pdfium.PdfDocument(data) as pdf:
                title = " ".join(str(pdf.get_metadata_dict().get("Title", "")).split()) or None
                pages = []
                for index in range(len(pdf)):
                    page = pdf[index]
                    pages.append(page.get_textpage().get_text_bounded())
                    page.close()  # and its text page: a long document is not held open page by page
        except pdfium.PdfiumError as e:
            raise FileUnreadable(f"the PDF file cannot be read: {e}") from None
    return "\n\n".join(pages), title
