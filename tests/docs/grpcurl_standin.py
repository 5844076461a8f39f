"""A stand-in for grpcurl, for machines without it: the subset of its
command line that docs/getting-started.md uses, done the way grpcurl does
it, through the server's reflection service alone (no stubs, no .proto).

    python grpcurl_standin.py [-plaintext] [-d JSON] [-H 'name: value'] ADDRESS SERVICE/METHOD
    python grpcurl_standin.py [-plaintext] ADDRESS list

grpcurl itself is a Go binary: neither PyPI nor Debian's archive carries an
official build, so the test suite cannot install it. The getting-started
test puts this script on PATH as `grpcurl` only when there is no grpcurl
there. Responses print as grpcurl (1.8.6, checked) prints them: one JSON
object per message, fields by their .proto names, default values left out.
"""

from __future__ import annotations

import sys

import grpc
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase


def fail(message: str) -> int:
    print(f"grpcurl stand-in: {message}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    data, headers, plaintext, positional = None, [], False, []
    it = iter(argv)
    for arg in it:
        if arg == "-plaintext":
            plaintext = True
        elif arg == "-d":
            data = next(it)
        elif arg == "-H":
            name, _, value = next(it).partition(":")
            headers.append((name.strip().lower(), value.strip()))
        elif arg.startswith("-"):
            return fail(f"flag {arg} is not implemented here")
        else:
            positional.append(arg)
    if not plaintext:
        return fail("only -plaintext is implemented here")
    if len(positional) != 2:
        return fail(f"expected ADDRESS and a method or `list`, got {positional}")
    address, target = positional
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        if target == "list":
            print("\n".join(sorted(database.get_services())))
            return 0
        service_name, _, method_name = target.replace("/", ".").rpartition(".")
        pool = DescriptorPool(database)
        method = pool.FindServiceByName(service_name).methods_by_name[method_name]
        request = message_factory.GetMessageClass(method.input_type)()
        json_format.Parse(data or "{}", request)
        response_cls = message_factory.GetMessageClass(method.output_type)
        path = f"/{service_name}/{method_name}"
        kwargs = dict(request_serializer=type(request).SerializeToString,
                      response_deserializer=response_cls.FromString)
        try:
            if method.server_streaming:
                responses = channel.unary_stream(path, **kwargs)(request, metadata=headers, timeout=60)
            else:
                responses = [channel.unary_unary(path, **kwargs)(request, metadata=headers, timeout=60)]
            for response in responses:
                print(json_format.MessageToJson(response, indent=2, preserving_proto_field_name=True))
        except grpc.RpcError as exc:
            print(f"ERROR:\n  Code: {exc.code().name}\n  Message: {exc.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
