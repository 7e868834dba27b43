"""The classify routes' multipart reader against bodies encoded by a real client (httpx)."""

import httpx
import pytest

from service.http.multipart import FormError, file_parts, is_multipart


def encode(files, data=None):
    req = httpx.Request("POST", "http://x/", files=files, data=data)
    return req.read(), req.headers["content-type"]


def test_reads_every_file_in_order_and_skips_text_fields():
    a, b = bytes(range(256)) * 3, b"--not-a-boundary\r\n\r\nstill data"
    body, ct = encode(
        [("images", ("a.png", a, "image/png")), ("images", ("b.png", b, "image/png"))],
        data={"note": "text field"},
    )
    assert is_multipart(ct)
    assert file_parts(body, ct, 10) == {"images": [a, b]}


def test_empty_file_is_kept_for_the_image_check_to_reject():
    body, ct = encode({"image": ("a.png", b"", "image/png")})
    assert file_parts(body, ct, 10) == {"image": [b""]}


@pytest.mark.parametrize(
    "mutate, status, words",
    [
        (lambda b, bnd: b.replace(b"--" + bnd + b"--", b""), 400, "no closing boundary"),
        (lambda b, bnd: b.replace(b"--" + bnd, b"--other"), 400, "boundary does not occur"),
        (lambda b, bnd: b.replace(b"\r\n\r\n", b"\r\n", 1), 400, "no header block"),
        (lambda b, bnd: b.replace(b'name="image"; ', b""), 400, "no field name"),
    ],
)
def test_malformed_bodies_are_400_naming_the_problem(mutate, status, words):
    body, ct = encode({"image": ("a.png", b"\x89PNG data", "image/png")})
    bnd = ct.split("boundary=")[1].encode()
    with pytest.raises(FormError) as e:
        file_parts(mutate(body, bnd), ct, 10)
    assert e.value.status == status and words in e.value.message


def test_part_limit_and_wrong_content_type():
    body, ct = encode([("images", (f"{i}.png", b"x", "image/png")) for i in range(5)])
    with pytest.raises(FormError) as e:
        file_parts(body, ct, 4)
    assert e.value.status == 413
    assert not is_multipart("application/json")
    with pytest.raises(FormError):
        file_parts(b"{}", "application/json", 4)
    with pytest.raises(FormError, match="boundary"):
        file_parts(body, "multipart/form-data", 4)


@pytest.mark.parametrize(
    "value",
    [
        b' form-data; name="image"; filename="q.png"',  # what httpx, requests, curl send
        b'form-data; name="images"',
        b'form-data; name="a"; filename=""',
        b'FORM-DATA ; name="i" ; filename="f.png" \t',
        b'attachment; name="x"; filename="\xe9t\xe9.png"',
        # not the plain form: the general parser's answer
        b'form-data; filename="x"; name="a"',
        b'form-data; name="a\\"b"; filename="C:\\\\dir\\\\y.png"',
        b"form-data; name=image; filename=q.png",
        b'form-data; name="a;b"',
        b"form-data; name=\"a\"; filename*=utf-8''x.png",
        b'form-data; Name="a"',
        b"form-data",
        b"",
    ],
)
def test_a_parts_name_and_filename_are_the_general_parsers(value):
    from python_multipart.multipart import parse_options_header

    from service.http.multipart import disposition

    _, p = parse_options_header(value)
    assert disposition(value) == (p.get(b"name"), p.get(b"filename"))
