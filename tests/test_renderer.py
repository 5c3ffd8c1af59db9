"""Issue 39, items 7 and 8: prompts are rendered by the file's own template through jinja by
default (llama.cpp's built-in matcher dropped the default system line SmolLM2's template adds),
and a file without a template gets its architecture's built-in one (Gemma 3: Gemma's turns, not
ChatML); ``use_jinja`` and ``chat_template`` override, and ``renderer`` says what was chosen."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import internals
import pytest

from llmsession import GenerationOptions, Model
from llmsession.errors import TemplateError
from llmsession.text.jinja import render_jinja
from llmsession.text.messages import check_messages, flatten_content
from llmsession.text.renderer import Renderer, choose_renderer

HI = [{"role": "user", "content": "Hi"}]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PARTS = CHATML.replace(
    "{{ m.content }}",
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{{ p.text }}"
    "{% endfor %}{% endif %}",
)
NO_SYSTEM = (
    "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}" + CHATML
)


# -- the choice (pure) ------------------------------------------------------------------------
def test_a_jinja_template_in_the_file_is_rendered_by_jinja() -> None:
    assert choose_renderer(CHATML, "llama") == Renderer(True, CHATML, "the file's template")
    assert choose_renderer(PARTS, "llama") == Renderer(True, PARTS, "the file's template", typed_content=True)


def test_a_template_that_reads_no_parts_gets_them_joined(smollm2: Model) -> None:
    """SmolLM2's template concatenates content to a str: a message with parts (an image, say)
    reaches it as one string, the image as the media marker, as llama-server does."""
    assert not smollm2.renderer.typed_content
    parts = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image_url"}]}]
    joined = flatten_content(parts[0]["content"], smollm2.media_marker)
    assert smollm2.render(parts) == smollm2.render([{"role": "user", "content": joined}])
    assert "Look:" in joined and smollm2.media_marker in joined


def test_a_file_without_a_template_gets_its_architectures_builtin() -> None:
    chosen = choose_renderer(None, "gemma3")
    assert (chosen.jinja, chosen.template) == (False, "gemma")
    assert "architecture 'gemma3'" in str(chosen) and "built-in 'gemma'" in str(chosen)
    unknown = choose_renderer(None, "llama")
    assert (unknown.jinja, unknown.template) == (False, None)
    assert "chatml default" in str(unknown)


def test_use_jinja_false_keeps_llama_cpps_matcher() -> None:
    chosen = choose_renderer(CHATML, "llama", use_jinja=False)
    assert (chosen.jinja, chosen.template) == (False, CHATML)
    assert "built-in template matcher" in str(chosen)


def test_a_template_jinja_cannot_render_falls_back_and_says_why() -> None:
    for broken in ("{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}", NO_SYSTEM):
        chosen = choose_renderer(broken, "llama")
        assert not chosen.jinja and chosen.template == broken
        assert "jinja could not render it" in chosen.note
    leaves_out = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    assert "leaves out the messages" in choose_renderer(leaves_out, "llama").note


# A template is the model file's code: what it raises, and what one expression of it would make
# past the bounds, is a TemplateError, so the load falls back as for any template jinja fails.
HOSTILE = [
    "{{ 'a' * 10**8 }}",  # repetition
    "{{ [0] * 10**8 }}",
    "{{ 9**(9**9) }}",  # a power (folded as a constant at compile time: it hung the load)
    "{{ '{:>1000000000}'.format(1) }}",  # a format width, written or taken from an argument
    "{{ '{:>{w}}'.format(1, w=10**9) }}",
    "{{ '{x:.1000000000f}'.format_map({'x': 1.0}) }}",
    "{{ '%1000000000d'|format(1) }}",
    "{{ '%*d'|format(1000000000, 1) }}",
    "{{ 'x'|center(10**9) }}",
    "{{ 'x'|indent(10**9) }}",
    "{{ 'a'.ljust(10**9) }}",
    "{{ ('a' * 1000).join(range(100000)) }}",
    "{{ ('a' * 10000).replace('', 'b' * 10000) }}",
    "{{ ('\t' * 1000).expandtabs(10**6) }}",
    "{{ 'a'['ljust'](10**9) }}",  # (a method reached by subscript, or by map)
    "{{ (['a']|map(attribute='ljust')|first)(10**9) }}",
    "{{ '%999999999s' % '' }}",  # (% formatting, folded at compile time too)
    "{{ '%(a)999999999s'|format(a=1) }}",
    "{{ ('a' * 10000)|replace('a', 'b' * 10000) }}",
    "{{ range(100000)|join('y' * 1000) }}",
    "{{ ('a\n' * 100000)|indent(1000) }}",
    "{{ [1]|tojson(indent=1000) }}",
    "{{ [1]|batch(10**9, 0)|list }}",
    "{{ lipsum(10**9) }}",  # (not offered)
    "{{ 'abc'|truncate(-5) }}",  # an AssertionError in a filter
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",  # a RecursionError
    "{{ cycler().next() }}",  # a RuntimeError
    # Built in many steps, each within the bounds (a string doubled line by line by ~ or +;
    # loops nested; a macro calling itself twice a level): steps counted, joins bounded.
    "{% set a = 'x' * 1000000 %}" + "{% set a = a ~ a %}" * 40 + "{{ a|length }}",
    "{% set a = 'x' * 1000000 %}" + "{% set a = a + a %}" * 40 + "{{ a|length }}",
    "{% set a = ['x'] * 1000000 %}" + "{% set a = a + a %}" * 40 + "{{ a|length }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
    # One step past the bounds by a way around them: bytes, an attribute, a nested key, a date.
    "{{ 'x'.encode() * 10**8 }}",
    "{{ 'x'.encode().ljust(10**9) }}",
    "{{ ('%999999999s'.encode() % 'x'.encode())|length }}",
    "{{ (1).to_bytes(10**9, 'big')|length }}",
    "{{ (['a'] * 100)|join('x' * 1000000, attribute=0) }}",
    "{{ '%(a(b))999999999s' % {'a(b)': 'x'} }}",
    "{{ strftime_now('%1000000Y') }}",
    # What jinja joins (a macro's output, a set block, the render) and the filters that grow
    # their value: each within its one operation's bound, 64 Mi characters in 0.1 s before.
    "{% macro d(s) %}{{ s }}{{ s }}{% endmacro %}{% set a = 'x' * 1000000 %}{{ d(d(d(d(d(d(a)))))) }}",
    "{% set a = 'x' * 9000000 %}{% set b %}{{ a }}{{ a }}{% endset %}{{ b|length }}",
    "{{ ('&' * 4000000)|e }}",
    "{% set b = ('\\x01' * 3000000)|tojson %}{{ b|length }}",  # (the filter's bound, not the output's)
    "{% set b = [[[[[[[[1] * 30000] * 2] * 2] * 2] * 2] * 2] * 2]|tojson(indent=64) %}{{ b|length }}",
    "{% set a = ['x' * 1000000] %}" + "{% set a = a + a %}" * 5 + "{{ a|string|length }}",
]


@pytest.mark.parametrize("expression", HOSTILE)
def test_a_hostile_templates_expression_is_a_template_error(expression: str) -> None:
    with pytest.raises(TemplateError, match="the chat template"):
        render_jinja(expression + CHATML, HI)
    chosen = choose_renderer(CHATML + expression, "llama")
    assert not chosen.jinja and "jinja could not render it" in chosen.note


def test_a_templates_ordinary_arithmetic_and_formatting_render() -> None:
    everyday = (
        "{{ '=' * 8 }}{{ [1] * 2 }}{{ 2**10 }}{{ 2**-1 }}{{ '{:>6,}'.format(1000) }}"
        "{{ '{a}'.format_map({'a': 1}) }}"
        "{{ '%5.1f%%'|format(2.25) }}{{ 'x'|center(5) }}|{{ 'a'.ljust(3) }}|{{ ', '.join(['a', 'b']) }}"
        "{{ 'ab'.replace('a', 'c') }}{{ 'y\ty'.expandtabs(2) }}{{ '%s!' % 'hi' }}{{ 'a\nb'|indent(2) }}"
        "{{ [1, 2]|tojson(indent=1) }}{{ ['a', 'b']|join('+') }}{{ 'a b'|wordwrap(1) }}"
        "{{ 'c'|replace('c', 'd') }}"
        "{{ [1, 2, 3]|batch(2)|list }}"
        "{{ 'a' ~ 1 ~ none }}{{ 'b' + 'c' }}{{ [1] + [2] }}{{ 1 + 2 }}{% for c in 'xy' %}{{ c }}{% endfor %}"
        "{{ strftime_now('%Y')|length }}{{ (65).to_bytes(1, 'big') }}{{ '%(a)s' % {'a': 'z'} }}"
    )
    expected = (
        "========[1, 1]10240.5 1,0001  2.2%  x  |a  |a, bcby yhi!a\n  b[\n 1,\n 2\n]a+ba\nbd[[1, 2], [3]]"
        "a1Nonebc[1, 2]3xy4b'A'z"
    )
    assert render_jinja(everyday, []) == expected
    long = [{"content": "word\n" * 300_000}]  # (1.5 M characters: within what one step may make)
    written = render_jinja("{{ messages[0].content.replace('word', 'words')|indent(2) }}", long)
    assert len(written) == 6 * 300_000 + 2 * (
        300_000 - 1
    )  # (a letter more a line, each but the first indented)


def test_a_lone_surrogate_a_template_writes_from_any_key_is_a_template_error() -> None:
    """Only the keys a check reads are checked; a template may write any other (the prompt
    would fail to encode in the tokenizer, a UnicodeEncodeError)."""
    with pytest.raises(TemplateError, match="lone surrogate"):
        render_jinja("{{ messages[0].date }}", [{"role": "user", "content": "a", "date": "\ud800"}])
    with pytest.raises(TemplateError, match=r"message 0: role: .*lone surrogate"):
        check_messages([{"role": "\ud800", "content": "x"}])


def test_without_jinja2_the_builtin_renders_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jinja2", None)
    never_compiled = CHATML + "{# not compiled before #}"
    chosen = choose_renderer(never_compiled, "llama")
    assert not chosen.jinja and "needs jinja2" in chosen.note


def test_use_jinja_true_insists() -> None:
    with pytest.raises(TemplateError, match="cannot render"):
        choose_renderer(NO_SYSTEM, "llama", use_jinja=True)
    with pytest.raises(TemplateError, match="needs a jinja chat template"):
        choose_renderer(None, "gemma3", use_jinja=True)
    with pytest.raises(TemplateError, match="has no template"):
        choose_renderer(None, "llama", use_jinja=True)


def test_chat_template_replaces_the_files() -> None:
    assert choose_renderer(CHATML, "llama", chat_template="gemma").template == "gemma"
    given = choose_renderer(None, "gemma3", chat_template=CHATML)
    assert given.jinja and given.template == CHATML and given.source == "chat_template given"
    with pytest.raises(TemplateError, match="chat_template must be"):
        choose_renderer(None, "llama", chat_template="  ")
    with pytest.raises(TemplateError, match="cannot render"):  # (never silently replaced)
        choose_renderer(CHATML, "llama", chat_template=NO_SYSTEM)
    assert not choose_renderer(CHATML, "llama", chat_template=NO_SYSTEM, use_jinja=False).jinja
    with pytest.raises(TemplateError, match="has a built-in template's name"):
        choose_renderer(CHATML, "llama", chat_template="gemma", use_jinja=True)


# -- on the models --------------------------------------------------------------------------------
def test_smollm2_renders_its_own_template_by_default(smollm2: Model) -> None:
    """The default prompt is the file's template through jinja, default system line and all;
    llama.cpp's matcher (the old default) writes ChatML without it."""
    assert smollm2.use_jinja and smollm2.renderer.jinja
    assert smollm2.template is not None and "{%" in smollm2.template
    own = render_jinja(smollm2.template, HI, bos_token="<|im_start|>", eos_token="<|im_end|>")
    assert smollm2.render(HI) == own
    assert "You are a helpful AI assistant named SmolLM" in own
    assert "prompts: jinja (the file's template)" in str(smollm2.memory())


def test_use_jinja_false_renders_without_the_default_system_line(smollm2_path: Path) -> None:
    with Model(smollm2_path, threads=2, kv_tokens=1024, use_jinja=False) as plain:
        assert not plain.use_jinja
        assert plain.render(HI) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_gemma3_without_a_template_speaks_gemmas_turns(gemma3: Model) -> None:
    """Gemma 3 270M's file has no template: the prompt is Gemma's turns (each marker one special
    token), not ChatML, and the renderer says why."""
    assert internals.local(gemma3).native.chat_template() is None
    assert gemma3.template == "gemma" and not gemma3.use_jinja
    assert "architecture 'gemma3'" in str(gemma3.renderer)
    text = gemma3.render([{"role": "system", "content": "Be brief."}, *HI])
    assert text == "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    tokens = gemma3.prompt_tokens(HI)
    start = gemma3.tokenize("<start_of_turn>", add_special=False)
    assert len(start) == 1 and tokens.count(start[0]) == 2
    reply = gemma3.chat(HI, GenerationOptions(max_tokens=8, temperature=0))
    assert "<|im_start|>" not in reply.text and "<|im_end|>" not in reply.text


def test_chat_template_overrides_by_name_text_or_file(gemma3_path: Path, tmp_path: Path) -> None:
    with Model(gemma3_path, threads=2, kv_tokens=1024, chat_template="chatml") as named:
        assert named.render(HI) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    (tmp_path / "t.jinja").write_text(CHATML.replace("<|im_start|>", "<<"))
    with Model(gemma3_path, threads=2, kv_tokens=1024, chat_template=tmp_path / "t.jinja") as filed:
        assert filed.use_jinja and filed.render(HI) == "<<user\nHi<|im_end|>\n<<assistant\n"
    with pytest.raises(TemplateError, match="no built-in chat template named 'nosuch'"):
        Model(gemma3_path, threads=2, kv_tokens=1024, chat_template="nosuch")
    with pytest.raises(TemplateError, match="cannot read the chat template file"):
        Model(gemma3_path, threads=2, kv_tokens=1024, chat_template=tmp_path / "missing.jinja")


def test_a_templates_steps_are_counted_however_it_loops_and_its_time_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loop wrapper was a name a template could define itself (its loops then uncounted); a
    recursive loop's ``loop(items)`` iterated uncounted; a step may be heavy (a sum of millions).
    (Bounds lowered here: the same refusals, sooner.)"""
    from llmsession.text import jinja_bounds

    monkeypatch.setattr(jinja_bounds, "MOST_STEPS", 5000)
    monkeypatch.setattr(jinja_bounds, "MOST_SECONDS", 1.0)
    for template, said in (
        (
            "{% macro _llmsession_iterated(x) %}{% endmacro %}{% set iterated = 0 %}"
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "too many steps",
        ),
        (
            "{% for x in [1] recursive %}{% if loop.depth < 9 %}{{ loop(range(100)) }}"
            "{% endif %}{% endfor %}",
            "too many steps",
        ),
        ("{% set big = [1] * 3000000 %}{% for i in range(1000) %}{{ big|sum }}{% endfor %}", "too long"),
    ):
        began = time.monotonic()
        with pytest.raises(TemplateError, match=said):
            render_jinja(template, HI)
        assert time.monotonic() - began < 10
    assert (
        render_jinja(
            "{% for m in messages recursive %}{{ m.role }}{{ loop.length }}{{ loop.cycle('a', 'b') }}"
            "{% if m.children %}{{ loop(m.children) }}{% endif %}{% endfor %}",
            [{"role": "u", "children": [{"role": "c", "children": []}]}, {"role": "v", "children": []}],
        )
        == "u2ac1av2b"
    )
