"""Handlers for tests/unit/rlhf/serving/test_model_process.py, run in a real model process
(rlhf.serving.model_process)."""

from __future__ import annotations

import os

from rlhf.serving import InvalidArgument


class Echo:
    def __init__(self, init: dict):
        if init.get("fail_loading"):
            raise ValueError("no such model: " + init["fail_loading"])
        self.hello = {"pid": os.getpid(), **init}

    def call(self, header: dict, payload: bytes) -> tuple[dict, bytes]:
        op = header["op"]
        if op == "echo":
            return {"n": len(payload), "header": header}, payload[::-1]
        if op == "invalid":
            raise InvalidArgument("items[3] is bad", "items[3]")
        if op == "custom":
            raise _Overflow("the model overflowed", "items[0]")
        if op == "crash":
            os._exit(7)
        if op == "print":
            print("a library printing to stdout must not break the frames")
            return {"printed": True}, b""
        raise ValueError(f"unknown op {op}")


class _Overflow(InvalidArgument):
    pass


def echo(init: dict) -> Echo:
    return Echo(init)
