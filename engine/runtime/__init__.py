"""The model runtime: forwards of a decoder stack and its MTP modules over
fixed KV slots, packed weights, rotary tables and the device choice.

It knows nothing of generation: no requests, sampling, drafting or
scheduling. The engine loop (``metrale.engine.engine``) imports it, never the
reverse; a test checks that importing it loads none of the loop, bench or
train modules."""
