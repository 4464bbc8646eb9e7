"""A rank's status page (state, heartbeat, pid in host shared memory): what
peers in other processes read without touching a device."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from dfccl import status_page
from dfccl.status_page import StatusPage


@pytest.fixture(autouse=True)
def page_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DFCCL_STATUS_DIR", str(tmp_path))
    return tmp_path


def _read_in_child(path, out):
    page = StatusPage.open(path)
    out.put(page.read())
    page.close()


def test_written_by_the_owner_read_by_another_process(page_dir):
    page = StatusPage.create(0)
    try:
        assert page.read() == (0, 0, os.getpid())
        page.write(2, 17)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        p = ctx.Process(target=_read_in_child, args=(page.path, out))
        p.start()
        got = out.get(timeout=30)
        p.join(30)
        assert got == (2, 17, os.getpid())
    finally:
        page.close()


def test_unlink_keeps_the_mappings_close_is_idempotent(page_dir):
    page = StatusPage.create(0)
    peer = StatusPage.open(page.path)
    page.unlink()
    assert not os.path.exists(page.path)
    page.write(1, 5)
    assert peer.read() == (1, 5, os.getpid())  # both mappings still see one page
    peer.close()
    peer.close()
    assert peer.read() == (0, 0, 0)
    page.close()
    page.close()


def test_a_peer_page_is_read_only(page_dir):
    page = StatusPage.create(0)
    peer = StatusPage.open(page.path)
    with pytest.raises(TypeError):
        peer.write(1, 1)
    peer.close()
    page.close()


def test_pages_of_exited_processes_are_swept(page_dir, monkeypatch):
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=os.getpid)
    p.start()
    p.join(30)
    stale = page_dir / f"dfccl-rank-{os.getuid()}-{p.pid}-0"
    stale.write_bytes(b"\0" * 64)
    mine = page_dir / f"dfccl-rank-{os.getuid()}-{os.getpid()}-999"
    mine.write_bytes(b"\0" * 64)
    monkeypatch.setattr(status_page, "_swept", False)
    page = StatusPage.create(0)
    try:
        assert not stale.exists()
        assert mine.exists()  # this process's own pages stay
    finally:
        page.close()
        mine.unlink()


def test_the_owner_removes_its_file_on_close(page_dir):
    page = StatusPage.create(0)
    path = page.path
    assert os.path.exists(path)
    page.close()
    assert not os.path.exists(path)
    assert not list(page_dir.iterdir())
