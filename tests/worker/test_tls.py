"""Connection URLs: TLS (amqps://) with a CA and a client certificate, against a local TLS endpoint;
secrets never reach the log."""
from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlencode, urlsplit

import pytest
from conftest import ROOT, worker_env

from worker.settings import redact_url

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("url, logged", [
    ("amqp://guest:s3cret@127.0.0.1:5672/", "amqp://guest:***@127.0.0.1:5672/"),
    ("amqp://T0KEN@broker/vh", "amqp://***@broker/vh"),  # a token as the user name
    ("amqps://u:p%40ss@[::1]:5671/%2f?cafile=/ca.pem", "amqps://u:***@[::1]:5671/%2f?cafile=/ca.pem"),
    ("amqp://:s3cret@broker", "amqp://:***@broker"),
    ("amqp://broker:5672/", "amqp://broker:5672/"),
    ("amqp://u:Sec/rS3t@127.0.0.1/", "amqp://***@127.0.0.1/"),  # an unescaped / ? # in the password
    ("amqp://u:a?b#c@h:5672/vh", "amqp://***@h:5672/vh"),
    ("amqp://u:p@ss@h/", "amqp://u:***@h/"),  # an unescaped @
    ("not a url u:pw@h", "***"),
])
def test_url_logged_without_password_or_token(url, logged):
    assert redact_url(url) == logged


# --- TLS: amqps:// with a CA and a client certificate -------------------------------------------

def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate, both signed by it."""
    d = tmp_path_factory.mktemp("certs")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=nllb test CA",
            cwd=d)
    for name, ext in (("server", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
                      ("client", "extendedKeyUsage=clientAuth\n")):
        (d / f"{name}.ext").write_text("basicConstraints=CA:FALSE\nauthorityKeyIdentifier=keyid\n" + ext)
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=nllb test {name}",
                cwd=d)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    return d


class TlsProxy:
    """A TLS endpoint in front of the broker: terminates TLS (the client must show a certificate the
    CA signed) and forwards the bytes to the broker's plain AMQP port. Runs in a thread of its own."""

    def __init__(self, certs: Path, upstream: tuple[str, int]) -> None:
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(certs / "ca.pem"))
        self.ctx.load_cert_chain(str(certs / "server.pem"), str(certs / "server.key"))
        self.ctx.verify_mode = ssl.CERT_REQUIRED
        self.upstream = upstream
        self.clients: list[str] = []  # the common name of each client certificate that connected
        self.loop = asyncio.new_event_loop()
        self.port = 0
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.ctx))
        self.port = server.sockets[0].getsockname()[1]
        started.set()
        self.loop.run_forever()
        server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        subject = dict(x[0] for x in writer.get_extra_info("peercert")["subject"])
        self.clients.append(subject["commonName"])
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def tls_url(certs: Path, broker: str):
    """An amqps:// URL to the broker through a TLS proxy, CA and client certificate as aio-pika takes
    them (query parameters cafile, certfile, keyfile)."""
    plain = urlsplit(broker)
    proxy = TlsProxy(certs, (plain.hostname or "127.0.0.1", plain.port or 5672))
    query = urlencode({"cafile": certs / "ca.pem", "certfile": certs / "client.pem", "keyfile": certs / "client.key"})
    yield f"amqps://{plain.username}:{plain.password}@localhost:{proxy.port}{plain.path or '/'}?{query}", proxy
    proxy.close()


def submit(url: str, names: dict[str, str], *texts: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "worker", "submit", "--src", "eng_Latn", "--tgt", "deu_Latn",
                           "--timeout", "60", "--url", url, "--queue", names["jobs_queue"], *texts], cwd=ROOT,
                          env=worker_env(names), capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.rabbitmq
def test_worker_and_producer_over_tls_with_a_client_certificate(tls_url, names, spawn):
    url, proxy = tls_url
    w = spawn("tls", NLLB_AMQP_URL=url)
    w.wait_ready()
    r = submit(url, names, "ta deshacho lidor tu nizela")
    assert r.returncode == 0, r.stderr
    reply = json.loads(r.stdout)
    assert reply["status"] == "ok" and reply["translations"][0]["text"] == "elaz ni tudor lichosha de ta"
    assert len(proxy.clients) >= 2 and set(proxy.clients) == {"nllb test client"}
    started = next(x for x in w.log_lines() if x.get("event") == "starting nllb-worker")
    assert started["settings"]["amqp_url"].startswith(f"amqps://guest:***@localhost:{proxy.port}/")
    assert w.terminate() == 0


@pytest.mark.rabbitmq
def test_tls_without_client_certificate_or_ca_is_refused_in_one_line(tls_url, names, certs):
    url, proxy = tls_url
    base, query = url.split("?")
    for refused in (f"{base}?cafile={certs / 'ca.pem'}", base):  # no client certificate; the CA unknown
        r = submit(refused, names, "hello")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"cannot reach the broker at amqps://guest:***@localhost:{proxy.port}/" in r.stderr
    assert proxy.clients == []
