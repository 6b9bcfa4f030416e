"""Uploaded files into text: each format converted as a reader sees it, titles found, formats told by
name or content type, and every file that cannot be read refused with `FileUnreadable` saying why."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from telerag.documents.conversion import SUPPORTED_EXTENSIONS, ConvertedFile, FileFormat, convert, file_format
from telerag.documents.errors import FileUnreadable, UnsupportedFile


def _literal(text: str) -> bytes:
    return b"(" + text.encode("cp1252").replace(b"\\", b"\\\\").replace(b"(", b"\\(").replace(b")", b"\\)") + b")"


def _content(page: list[str] | bytes) -> bytes:
    """A page's content stream: its lines shown one under another, or a stream given as it is."""
    if isinstance(page, bytes):
        return page
    return b"BT /F1 12 Tf 14 TL 72 720 Td " + b"".join(_literal(line) + b" Tj T* " for line in page) + b"ET"


def make_pdf(pages: list[list[str] | bytes], title: str | None = None) -> bytes:
    """A valid PDF, as a word processor writes one: each page shows its lines in Helvetica (a text
    layer), or runs the given content stream as it is (bytes: a drawing with no text)."""
    contents = [_content(page) for page in pages]
    kids = b" ".join(b"%d 0 R" % (4 + 2 * i) for i in range(len(pages)))
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, len(pages)),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>",
    ]
    for i, content in enumerate(contents):
        resources = b"/Resources << /Font << /F1 3 0 R >> >>"
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] %s /Contents %d 0 R >>" % (resources, 5 + 2 * i))
        objects.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(content), content))
    info = b""
    if title is not None:
        objects.append(b"<< /Title " + _literal(title) + b" >>")
        info = b" /Info %d 0 R" % len(objects)
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R%s >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, info, xref)
    return bytes(out)


LETTER = make_pdf(
    [["Dear Mr. Barrieres,", "You have been lobbying the government to pro-", "hibit the use of open source (free) software."]],
    title="  A   letter ",
)
PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>Volcanoes  of
 Iceland</title><style>p { color: red } .zzstyle {}</style><script>var zzscript = "hidden";</script></head>
<body><nav><a href="/">zznav Home</a> <a href="/about">About</a></nav>
<h1>Eruptions</h1><p>alpha</p><p>beta</p><div>gamma</div>
<p>A won<b>der</b>ful <a href="#">lava</a> field, Tom &amp; Jerry&nbsp;&lt;3 caf&eacute;.</p>
<ul><li>one</li><li>two</li></ul><table><tr><td>cell1</td><td>cell2</td></tr></table>line1<br>line2
<pre>fn main() {
    eruption();
}</pre><noscript>zznoscript</noscript><template>zztemplate</template><svg><title>zzpicture</title></svg>
<!-- zzcomment --></body></html>"""


def test_a_text_file_is_decoded_with_its_lines_and_paragraphs():
    data = "\ufeffFirst   line\r\nsecond\tline\n\n\n\nThird paragraph, naïve café  \n".encode()
    expected = ConvertedFile(text="First line\nsecond line\n\nThird paragraph, naïve café", title=None)
    assert convert(data, FileFormat.TEXT) == expected


def test_markdown_is_kept_as_written_and_its_first_heading_is_its_title():
    fence = "```sh\n# not a title: a shell comment\n```"
    markdown = f"{fence}\n\nIntro text.\n\n# Volcanoes of  Iceland #\n\n\n## Eruptions\n\nLava *flows*.\n"
    converted = convert(markdown.encode(), FileFormat.MARKDOWN)
    assert converted.title == "Volcanoes of Iceland"
    assert converted.text == f"{fence}\n\nIntro text.\n\n# Volcanoes of Iceland #\n\n## Eruptions\n\nLava *flows*."
    assert convert(b"## Only a second-level heading\n\nText.", FileFormat.MARKDOWN).title is None


def test_html_gives_the_words_a_reader_sees_in_paragraphs():
    converted = convert(PAGE.encode(), FileFormat.HTML)
    assert converted.title == "Volcanoes of Iceland"
    assert converted.text == (
        "Eruptions\n\nalpha\n\nbeta\n\ngamma\n\nA wonderful lava field, Tom & Jerry <3 café.\n\none\n\ntwo\n\n"
        "cell1 cell2\n\nline1\nline2\n\nfn main() {\neruption();\n}"
    )
    assert "zz" not in converted.text  # script, style, nav, noscript, template, an SVG's title, comments


def test_an_html_title_is_its_first_h1_without_a_title_element_and_none_without_either():
    assert convert(b"<body><h1>Lava <i>fields</i></h1><h1>Second</h1><p>Text.</p></body>", FileFormat.HTML).title == "Lava fields"
    assert convert(b"<title> </title><p>Text.</p>", FileFormat.HTML).title is None
    assert convert(b"Plain words, <b>no</b> page around them.", FileFormat.HTML) == ConvertedFile(
        "Plain words, no page around them.", None
    )


def test_html_in_a_declared_legacy_encoding_is_decoded_as_declared():
    page = '<html><head><meta charset="windows-1252"></head><body><p>“Quoted” café – 5€</p></body></html>'.encode("cp1252")
    assert convert(page, FileFormat.HTML).text == "“Quoted” café – 5€"
    latin1 = '<meta http-equiv="Content-Type" content="text/html; charset=ISO-8859-1"><p>déjà vu</p>'.encode("latin-1")
    assert convert(latin1, FileFormat.HTML).text == "déjà vu"


def test_a_pdf_gives_its_text_and_its_metadata_title():
    converted = convert(LETTER, FileFormat.PDF)
    assert converted.title == "A letter"
    # a word hyphenated across a line end comes out whole
    assert converted.text == (
        "Dear Mr. Barrieres,\nYou have been lobbying the government to prohibit the use of open source (free) software."
    )


def test_a_pdf_of_several_pages_gives_them_in_order_a_blank_line_apart():
    pdf = make_pdf([["Page one text."], ["Page two, first line.", "Page two, second line."], ["Page three."]])
    assert convert(pdf, FileFormat.PDF) == ConvertedFile(
        "Page one text.\n\nPage two, first line.\nPage two, second line.\n\nPage three.", title=None
    )
    assert convert(make_pdf([["Words."]], title="   "), FileFormat.PDF).title is None


def test_pdfs_converted_on_many_threads_at_once_all_come_out_whole():
    """The server converts uploads on worker threads, and PDFium is not thread-safe: without the
    module's lock, this crashes the process (a segmentation fault) in some runs."""
    pages = [[[f"Document {n} page {p}, line {i}." for i in range(40)] for p in range(4)] for n in range(8)]
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda doc: convert(make_pdf(doc), FileFormat.PDF).text, pages * 5))
    assert texts == ["\n\n".join("\n".join(lines) for lines in doc) for doc in pages] * 5


@pytest.mark.parametrize(
    ("filename", "content_type", "expected"),
    [
        ("notes.txt", None, FileFormat.TEXT),
        ("NOTES.TEXT", None, FileFormat.TEXT),
        ("docs/README.md", "application/octet-stream", FileFormat.MARKDOWN),
        ("C:\\Users\\me\\guide.Markdown", None, FileFormat.MARKDOWN),
        ("page.htm", None, FileFormat.HTML),
        ("page.html", "text/plain", FileFormat.HTML),  # the extension wins
        ("paper.PDF", None, FileFormat.PDF),
        ("upload", "text/plain; charset=utf-8", FileFormat.TEXT),
        ("upload", "Text/Markdown", FileFormat.MARKDOWN),
        ("upload.bin", "text/html; charset=ISO-8859-1", FileFormat.HTML),
        ("upload", "application/pdf", FileFormat.PDF),
    ],
)
def test_the_format_is_told_by_extension_then_by_content_type(filename, content_type, expected):
    assert file_format(filename, content_type, b"\x00 binary, so its content would tell nothing") is expected


ZIP = b"PK\x03\x04\x14\x00\x06\x00\x08\x00\x00\x00!\x00"


@pytest.mark.parametrize(
    ("filename", "content_type", "data", "expected"),
    [
        ("README", None, b"# telerag\n\nA RAG server.\n", FileFormat.TEXT),
        ("LICENSE", "application/octet-stream", b"Apache License\nVersion 2.0, January 2004\n", FileFormat.TEXT),
        ("Makefile", None, b"all:\n\tpython -m build\n", FileFormat.TEXT),
        ("notes.rst", None, "Caf\u00e9 notes\n==========\n".encode(), FileFormat.TEXT),
        ("NOTES", "text/x-rst", b"Notes\n=====\n", FileFormat.TEXT),  # any text/* type is text
        ("latin1", None, b"caf\xe9", FileFormat.TEXT),  # text by its bytes; `convert` names the byte that is not UTF-8
        ("index", "application/octet-stream", b"\xef\xbb\xbf  <!DOCTYPE html><html><p>hi</p></html>", FileFormat.HTML),
        ("page", None, b"<!-- saved --><HTML lang=en><body>hi</body></HTML>", FileFormat.HTML),
        ("scan", "application/octet-stream", b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj", FileFormat.PDF),
    ],
)
def test_where_name_and_type_say_nothing_the_content_tells_text_html_and_pdf(filename, content_type, data, expected):
    assert file_format(filename, content_type, data) is expected


def test_every_supported_extension_is_lower_case_and_dotted():
    assert all(extension == extension.lower() and extension.startswith(".") for extension in SUPPORTED_EXTENSIONS)


@pytest.mark.parametrize(
    ("filename", "content_type", "data", "named"),
    [
        ("sheet.xlsx", "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet", ZIP, ["'.xlsx'", "spreadsheetml"]),
        ("photo.jpeg", None, b"\xff\xd8\xff\xe0\x00\x10JFIF\x00", ["'.jpeg'", "not text"]),
        ("upload", "image/png; q=1", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", ["'image/png'"]),
        ("upload", None, ZIP, ["no extension and no content type", "not text"]),
    ],
)
def test_an_unsupported_file_is_refused_naming_its_type(filename, content_type, data, named):
    with pytest.raises(UnsupportedFile) as refused:
        file_format(filename, content_type, data)
    assert all(name in str(refused.value) for name in named)
    assert refused.value.code == "unsupported_file"


@pytest.mark.parametrize("fmt", [FileFormat.TEXT, FileFormat.MARKDOWN, FileFormat.HTML])
def test_invalid_utf8_is_refused_naming_the_byte_offset(fmt):
    with pytest.raises(FileUnreadable, match=r"not valid utf-8: byte 0xff at offset 9"):
        convert(b"caf\xc3\xa9 ok \xff then more", fmt)
    with pytest.raises(FileUnreadable, match=r"offset 4"):  # counted in the file, its byte-order mark included
        convert(b"\xef\xbb\xbfa\xe9", fmt)


@pytest.mark.parametrize("cut", [0.1, 0.5, 0.9])
def test_a_truncated_pdf_is_refused(cut):
    with pytest.raises(FileUnreadable, match="PDF file cannot be read"):
        convert(LETTER[: int(len(LETTER) * cut)], FileFormat.PDF)


@pytest.mark.parametrize("data", [b"", b"%PDF-1.7\n" + bytes(range(256)) * 8, b"<html><body>not a pdf</body></html>"])
def test_what_is_not_a_pdf_is_refused_as_one(data):
    with pytest.raises(FileUnreadable) as refused:
        convert(data, FileFormat.PDF)
    assert refused.value.code == "unreadable_file"


def test_a_pdf_without_a_text_layer_is_refused_saying_so():
    scanned = make_pdf([b"0 0 1 rg 72 72 400 600 re f", b"1 0 0 rg 100 100 50 50 re f"])  # pictures of pages, no text
    with pytest.raises(FileUnreadable, match="no text layer"):
        convert(scanned, FileFormat.PDF)


@pytest.mark.parametrize(
    ("data", "fmt"),
    [
        (b"", FileFormat.TEXT),
        (b" \n\t\r\n ", FileFormat.MARKDOWN),
        (b"<html><head><title>Only a title</title><script>var x = 1;</script></head><body></body></html>", FileFormat.HTML),
    ],
)
def test_a_file_with_no_text_is_refused(data, fmt):
    with pytest.raises(FileUnreadable, match="has no text"):
        convert(data, fmt)


def test_malformed_markup_is_read_as_a_browser_reads_it():
    """A stray `<![` hides what a browser hides (up to the next `>`), and the rest of the page stays."""
    page = b"<p>Word <![if !supportLists]>1.<![endif]> item</p><p>a stray <![ marked section</p><p>after</p>"
    assert convert(page, FileFormat.HTML).text == "Word 1. item\n\na stray\n\nafter"


def test_importing_the_module_does_not_load_the_pdf_library():
    code = "import sys, telerag.documents.conversion; print('pypdfium2' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
