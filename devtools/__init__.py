"""Developer tools, above every product package: the generators of the
documentation's reference regions (docgen) and of the gRPC stubs
(genproto). Nothing in the services, bench or the simulator imports them."""
