#!/usr/bin/env python3
"""Write tests/data/tokenizer/corpus.jsonl: the texts every tokenizer reference is
computed on (one JSON string per line).

The cases aim at the places where byte-level BPE implementations disagree: the
pre-tokenizer regex (contractions, digit runs, whitespace before non-space,
newlines, Unicode letters vs marks vs numbers), NFC normalization, added tokens
written literally, and long inputs. Edit the lists below and rerun
tools/tokref/regen.sh to refresh the reference ids.
"""
import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "..", "tests", "data", "tokenizer", "corpus.jsonl")

cases = [
    "",
    " ",
    "a",
    "Hello world",
    "Hello, world! How are you today?",
    " leading space",
    "trailing space ",
    "trailing spaces   ",
    "  two leading spaces",
    "multiple   internal    spaces",
    # contractions, both cases (the regex is case-insensitive for them)
    "it's don't we're they've I'm you'll he'd",
    "IT'S DON'T WE'RE THEY'VE I'M YOU'LL HE'D",
    "It'S dOn'T 'sup 'tis rock'n'roll",
    "'s 't 're 've 'm 'll 'd",
    "''s '' 'x",
    # digits: Qwen splits every digit, Llama 3 groups by up to three
    "1", "12", "123", "1234", "12345", "123456", "1234567", "12345678", "123456789", "1234567890",
    "3.14159 2.71828 -42 +7 1e10 0x1F 1,000,000 $19.99 50%",
    "Call 555-0123 before 2024-06-30T12:34:56Z.",
    "٣٤٥ ۱۲۳ १२३ ๑๒๓ ½ ² Ⅻ",  # non-ASCII digits and numerics
    # prose
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "In 1905, Einstein published four papers; the third (on special relativity) changed physics forever.",
    "She said: \"Don't go!\" -- but he'd already left... (or had he?)",
    # code
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "#include <stdio.h>\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i] * c; } // axpy",
    "const x = () => { return {a: 1, b: [2, 3]}; };",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "    indented four\n        indented eight\n\t\ttabs\n",
    "x=1;y=2\r\nz=3\r\n",
    "if(a&&b||!c){return;}else{a^=b<<2>>1;}",
    "<html><body class=\"main\">Hi &amp; bye</body></html>",
    "https://example.com/path?q=1&r=two#frag user@example.org",
    "```python\nprint('hi')\n```",
    "a_b_c __init__ CamelCaseWord snake_case_word kebab-case-word",
    # whitespace
    "line1\nline2\n\nline4\n\n\n",
    "\n",
    "\n\n\n\n",
    "\r\n",
    "\r\n\r\n",
    "\t",
    "\t\t\tx",
    "a\tb\tc",
    "space then newline \n next",
    "spaces then newline    \n    next",
    " \n \n ",
    "end with newline and spaces\n   ",
    "x" + " " * 1000 + "y",
    " " * 1000,
    "\n" * 300,
    "\t " * 50 + "z",
    "\u00a0nbsp\u00a0here\u2003em space\u3000ideographic space",
    "\u2028line separator\u2029paragraph separator",
    "\u0085next line\u000bvertical tab\u000cform feed",
    "zero\u200bwidth\u200cjoiner\u200dchars\ufeffbom",
    # CJK and other scripts
    "你好，世界！我们今天去哪里？",
    "日本語のテキストです。カタカナとひらがな、漢字。",
    "한국어 텍스트입니다. 안녕하세요!",
    "中文English混合text测试123数字",
    "Привет, мир! Как дела?",
    "Γειά σου Κόσμε",
    "مرحبا بالعالم، كيف حالك؟",
    "שלום עולם",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่าง",
    "Tiếng Việt có dấu: Đường phố Hà Nội",
    "ქართული ენა",
    "Ελληνικά, Русский, العربية, 中文, हिन्दी in one line",
    # emoji
    "I love 🍕 and 🍣!",
    "👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🧑🏿‍💻",
    "🇺🇸🇯🇵🇩🇪🇫🇷",
    "❤️ ✔️ ☺ ⚡",
    "😀😃😄😁😆😅😂🤣",
    # combining marks and normalization (Qwen normalizes to NFC first)
    "e\u0301",  # e + combining acute -> é under NFC
    "cafe\u0301 vs café",
    "a\u0308o\u0308u\u0308 A\u030a",
    "\u1100\u1161\u11a8",  # conjoining Hangul jamo -> one syllable under NFC
    "\uf900\uf901 compatibility ideographs",
    "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f\u031e\u0320\u034dalgo text",
    "ﬁ ﬂ ligatures and ＦＵＬＬＷＩＤＴＨ",
    "\u212b angstrom sign, \u2126 ohm sign",
    # letters outside the basic planes, math, symbols
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙 𝒮𝒸𝓇𝒾𝓅𝓉",
    "∀x∈ℝ: x² ≥ 0 ⇒ √(x²) = |x|",
    "© ® ™ € £ ¥ § ¶ † ‡ • … ‰ ′ ″",
    "←↑→↓ ┌─┐│└┘ ░▒▓█",
    "long s ſ and kelvin K",
    # special tokens written literally (compared with parse_special on)
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|endoftext|>more text",
    "<think>\nreasoning here\n</think>\n\nanswer",
    "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "<|im_start|><|im_end|><|im_start|>",
    "<|im_start",
    "< |im_start| >",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "<|fim_prefix|>def f(<|fim_suffix|>):<|fim_middle|>",
    # long words and repetition
    "a" * 500,
    "ab" * 300,
    "supercalifragilisticexpialidocious " * 10,
    "Pneumonoultramicroscopicsilicovolcanoconiosis" * 5,
    "!!!!!!!!!!????????........,,,,,,,;;;;;;",
    "----------==========__________**********",
    "The the THE tHe",
]

# Deterministic pseudo-random mixes (seeded; Python's random is stable for a seed).
rng = random.Random(20240607)
alphabet = ("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
            " \t\n\r.,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`"
            "éèêëçàâäöüßñ你好世界日本語한국어Привет😀👍🏽🇯🇵\u0301\u00a0")
for _ in range(40):
    n = rng.randint(1, 80)
    cases.append("".join(rng.choice(alphabet) for _ in range(n)))

with open(OUT, "w", encoding="utf-8") as f:
    for c in cases:
        f.write(json.dumps(c, ensure_ascii=True) + "\n")
print(f"wrote {len(cases)} cases to {os.path.relpath(OUT)}")
