"""Chat templates in the shapes real models ship, as test data: a
Llama-3-style one that puts bos_token in the text, a Qwen2-style ChatML one,
and one that exercises the sandbox's globals and whitespace options."""

LLAMA3_STYLE = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

QWEN2_STYLE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Block tags on their own lines: trim_blocks / lstrip_blocks decide the
# whitespace. Uses namespace, tojson, strftime_now, loop controls and the
# generation tag, and raise_exception for a role it does not know.
FEATURES = """{{ bos_token }}
{% set ns = namespace(count=0) %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% set ns.count = ns.count + 1 %}
    {% if message['role'] == 'system' %}
[SYS {{ strftime_now('%Y') }}] {{ message['content'] | tojson }}
        {% continue %}
    {% endif %}
    {% if message['role'] == 'assistant' %}
A: {% generation %}{{ message['content'] }}{% endgeneration %}{{ eos_token }}
    {% else %}
U{{ ns.count }}: {{ message['content'] }}{% if message.name is defined %} ({{ message.name }}){% endif %}

    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
A:{% endif %}"""

ALL = {"llama3": LLAMA3_STYLE, "qwen2": QWEN2_STYLE, "features": FEATURES}
