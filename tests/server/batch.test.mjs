// Continuous batching behind `kvq serve`, through the openai npm client:
// concurrent requests decode together in the scheduler's steps and each
// returns exactly its solo text, preempted ones too; prompts that share an opening reuse its
// cached KV pages and still return exactly what they return without the
// cache; clients that hang up at random moments leave no KV page held
// (/metrics).
//
// Exactness: the CPU backend computes each token of a call of up to 64
// tokens on its own (docs/architecture.md, "The step batch"), so with steps
// of at most 64 tokens (--prefill-chunk 64) a sequence's logits do not
// depend on what shares its steps: greedy and seeded outputs match the solo
// run exactly.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { loadOpenAI, startServer, metric, until, MODEL } from './kvq_server.mjs';

const OpenAI = await loadOpenAI();
const MAX_SEQS = 16;
const MAX_QUEUE = 16;
let srv, client;

before(async () => {
  srv = await startServer(['--ctx', '512', '--max-seqs', String(MAX_SEQS), '--max-queue', String(MAX_QUEUE),
                           '--prefill-chunk', '64']);
  client = new OpenAI({ baseURL: srv.baseURL, apiKey: 'unused', maxRetries: 0, timeout: 120_000 });
});

after(async () => {
  assert.ok(srv.alive(), 'the server survived');
  assert.equal(await srv.stop(), 0);
});

const codePrompts = ['def add(a, b):\n', 'import os\nimport sys\n', 'class Stack:\n', 'for i in range(10):\n',
                     'def fibonacci(n):\n', '# read a file\n', 'def is_prime(n):\n', 'x = [1, 2, 3]\n'];
const chatPrompts = ['Write a Python function that reverses a string.', 'Sort a list in Python', 'How do I read a file?',
                     'Write a function that adds two numbers.', 'What is a dict?', 'Explain recursion.',
                     'Write a class for a queue.', 'How do I parse JSON?'];

// Request i of 16: completions for even i, chat for odd; streamed or not; two ask for logprobs.
function requestOf(i, extra = {}) {
  const common = { model: MODEL, max_tokens: 24, temperature: 0, ...extra };
  if (i % 2 === 0) return { kind: 'completion', body: { ...common, prompt: codePrompts[i / 2], ...(i === 4 ? { logprobs: 2 } : {}) } };
  return { kind: 'chat', body: { ...common, messages: [{ role: 'user', content: chatPrompts[(i - 1) / 2] }],
                                 ...(i === 7 ? { logprobs: true, top_logprobs: 2 } : {}) } };
}

async function run({ kind, body }, stream) {
  const api = kind === 'chat' ? client.chat.completions : client.completions;
  const piece = (c) => (kind === 'chat' ? c.choices[0]?.delta?.content : c.choices[0]?.text) ?? '';
  if (!stream) {
    const r = await api.create(body);
    return kind === 'chat' ? r.choices[0].message.content : r.choices[0].text;
  }
  let text = '';
  for await (const c of await api.create({ ...body, stream: true })) text += piece(c);
  return text;
}

test('16 concurrent streams each return their solo text', async () => {
  const reqs = Array.from({ length: 16 }, (_, i) => requestOf(i));
  const solo = [];
  for (const r of reqs) solo.push(await run(r, false));  // one at a time
  assert.ok(solo.filter((t) => t.length > 0).length >= 8, JSON.stringify(solo));

  const steps0 = await metric(srv.url, 'kvq_steps_total');
  const decode0 = await metric(srv.url, 'kvq_step_decode_tokens_total');
  const together = await Promise.all(reqs.map((r) => run(r, true)));
  for (let i = 0; i < 16; i++) assert.equal(together[i], solo[i], `request ${i} (${reqs[i].kind})`);
  // They shared steps: far fewer steps than decoded tokens.
  const steps = (await metric(srv.url, 'kvq_steps_total')) - steps0;
  const decoded = (await metric(srv.url, 'kvq_step_decode_tokens_total')) - decode0;
  assert.ok(decoded >= 16 && steps * 2 < decoded, `${steps} steps for ${decoded} decode tokens`);

  // Seeded sampling too: each sequence has its own sampler and seed.
  const sampled = [0, 3, 6, 9].map((i) => requestOf(i, { temperature: 1, top_k: 0, top_p: 1, seed: 100 + i }));
  const soloSampled = [];
  for (const r of sampled) soloSampled.push(await run(r, false));
  const togetherSampled = await Promise.all(sampled.map((r) => run(r, true)));
  assert.deepEqual(togetherSampled, soloSampled);
  console.log(`batch: 16 streams matched their solo text in ${steps} steps for ${decoded} decode tokens`);
});

test('prefix caching: shared openings are not prefilled again, and the text is the same without it', async () => {
  // About 250 tokens of shared context (four 64-token pages), then different questions.
  const context = Array.from({ length: 24 }, (_, i) => `def f${i}(x):\n    return x * ${i} + ${i % 7}\n`).join('');
  const endings = ['\ndef main():\n', '\nclass Table:\n', '\n# tests\n', '\nimport json\n', '\nx = f3(2)\n',
                   '\ndef g(y):\n'];
  const body = (i, extra = {}) => ({ model: MODEL, prompt: context + endings[i], max_tokens: 16, temperature: 0, ...extra });
  const uncached = [];
  for (let i = 0; i < endings.length; i++) {
    const r = await client.completions.create(body(i, { cache_prompt: false }));
    uncached.push(r.choices[0].text);
  }
  const hits0 = await metric(srv.url, 'kvq_prefix_cache_hit_tokens_total');
  const prefill0 = await metric(srv.url, 'kvq_step_prefill_tokens_total');
  // The first warms the cache; the rest run together and find its pages.
  const first = await client.completions.create(body(0));
  assert.equal(first.choices[0].text, uncached[0]);
  const rest = await Promise.all(endings.slice(1).map(async (_, k) => {
    let text = '';
    for await (const c of await client.completions.create({ ...body(k + 1), stream: true })) text += c.choices[0]?.text ?? '';
    return text;
  }));
  for (let i = 1; i < endings.length; i++) assert.equal(rest[i - 1], uncached[i], `prompt ${i}`);
  const hits = (await metric(srv.url, 'kvq_prefix_cache_hit_tokens_total')) - hits0;
  const prefilled = (await metric(srv.url, 'kvq_step_prefill_tokens_total')) - prefill0;
  const promptTokens = first.usage.prompt_tokens;
  assert.ok(hits >= 5 * 192, `${hits} cached prompt tokens reused by the five later prompts`);
  assert.ok(prefilled < 2 * promptTokens, `${prefilled} tokens prefilled for six prompts of ~${promptTokens}`);
  console.log(`prefix cache: ${hits} prompt tokens reused, ${prefilled} prefilled for 6 prompts of ~${promptTokens}`);
});

test('n choices: one prefill of the prompt, each choice its own seeded sequence', async () => {
  const prompt = Array.from({ length: 12 }, (_, i) => `value_${i} = compute(${i}, ${i * 3})\n`).join('') + 'def report():\n';
  const body = { model: MODEL, prompt, max_tokens: 12, temperature: 0.9, top_k: 0, top_p: 1, seed: 40 };
  const alone = [];
  for (let c = 0; c < 3; c++) {
    const r = await client.completions.create({ ...body, seed: 40 + c, cache_prompt: false });
    alone.push(r.choices[0].text);
  }
  const prefill0 = await metric(srv.url, 'kvq_step_prefill_tokens_total');
  const r = await client.completions.create({ ...body, n: 3, cache_prompt: false });
  const prefilledUncached = (await metric(srv.url, 'kvq_step_prefill_tokens_total')) - prefill0;
  assert.deepEqual(r.choices.map((c) => c.index), [0, 1, 2]);
  assert.deepEqual(r.choices.map((c) => c.text), alone);
  assert.equal(r.usage.prompt_tokens, (await client.completions.create({ ...body, max_tokens: 1 })).usage.prompt_tokens);
  // With the cache (the default) the three sequences prefill the prompt once.
  const prefill1 = await metric(srv.url, 'kvq_step_prefill_tokens_total');
  const cached = await client.completions.create({ ...body, n: 3, seed: 41 });
  const prefilled = (await metric(srv.url, 'kvq_step_prefill_tokens_total')) - prefill1;
  assert.equal(cached.choices[0].text, alone[1]);
  assert.equal(cached.choices[1].text, alone[2]);
  assert.ok(prefilledUncached >= 3 * r.usage.prompt_tokens, `${prefilledUncached} prefilled without the cache`);
  assert.ok(prefilled < r.usage.prompt_tokens, `${prefilled} prefilled with the cache (the prompt was cached before)`);
  // Streamed: every choice's chunks carry its index, and each choice ends once.
  const texts = ['', ''];
  const ends = [0, 0];
  for await (const c of await client.completions.create({ ...body, n: 2, stream: true })) {
    const ch = c.choices[0];
    if (!ch) continue;
    texts[ch.index] += ch.text ?? '';
    if (ch.finish_reason) ends[ch.index]++;
  }
  assert.deepEqual(texts, alone.slice(0, 2));
  assert.deepEqual(ends, [1, 1]);
});

test('preempted and resumed requests return their solo text', async () => {
  // A pool of 4 pages (256 tokens, one --ctx) for four requests that grow to ~110 tokens (2 pages) each: as
  // they grow the youngest are preempted (recomputed) and resumed. The prefix cache is off so that each
  // resumption recomputes (with it on, a resumed sequence would adopt its own cached pages instead).
  const small = await startServer(['--ctx', '256', '--max-seqs', '4', '--kv-pages', '4', '--prefill-chunk', '64',
                                   '--no-prefix-cache']);
  try {
    const c = new OpenAI({ baseURL: small.baseURL, apiKey: 'unused', maxRetries: 0, timeout: 120_000 });
    const bodies = codePrompts.slice(0, 4).map((prompt, i) => ({ model: MODEL, prompt, max_tokens: 100, temperature: 0,
                                                                  ignore_eos: true, ...(i % 2 ? { seed: 5 } : {}) }));
    const solo = [];
    for (const b of bodies) solo.push((await c.completions.create(b)).choices[0].text);
    const pre0 = await metric(small.url, 'kvq_preemptions_total');
    const together = await Promise.all(bodies.map(async (b) => {
      let text = '';
      for await (const ch of await c.completions.create({ ...b, stream: true })) text += ch.choices[0]?.text ?? '';
      return text;
    }));
    const preempted = (await metric(small.url, 'kvq_preemptions_total')) - pre0;
    assert.ok(preempted > 0, 'the small pool forced preemptions');
    assert.deepEqual(together, solo);
    console.log(`preemption: ${preempted} preemptions, every text equal to its solo run`);
  } finally {
    assert.equal(await small.stop(), 0);
  }
});

// A tiny deterministic generator, so a failure repeats.
function rng(seed) {
  let s = seed >>> 0;
  return () => ((s = (Math.imul(s, 1664525) + 1013904223) >>> 0) / 2 ** 32);
}

test('random disconnects leave no KV page held', async () => {
  const rand = rng(26);
  const total = await metric(srv.url, 'kvq_kv_pages_total');
  assert.ok(total > 0);
  const cancelled0 = await metric(srv.url, 'kvq_requests_cancelled_total');
  // Greedy repeats this line for hundreds of tokens: such a request runs until max_tokens or its client leaves.
  const endless = { model: MODEL, prompt: 'x = 1\nx = 1\nx = 1\n', max_tokens: 480, temperature: 0 };
  const N = 24;  // within --max-seqs + --max-queue: none is refused
  let sawPages = false;
  const watch = (async () => {
    for (let i = 0; i < 200 && !sawPages; i++) {
      if ((await metric(srv.url, 'kvq_kv_pages_used')) > 0) sawPages = true;
      else await new Promise((r) => setTimeout(r, 10));
    }
  })();
  const results = await Promise.all(Array.from({ length: N }, async (_, k) => {
    const kind = ['stream-hang-up', 'abort', 'finish'][k % 3];
    const delay = Math.floor(rand() * 400);
    await new Promise((r) => setTimeout(r, Math.floor(rand() * 100)));
    try {
      if (kind === 'stream-hang-up') {
        const stream = await client.completions.create({ ...endless, stream: true });
        const cut = Date.now() + delay;
        for await (const c of stream) if (Date.now() >= cut && c.choices[0]?.text) break;  // closes the connection
        return { k, kind };
      }
      if (kind === 'abort') {
        const ac = new AbortController();
        setTimeout(() => ac.abort(), delay);
        await client.completions.create(endless, { signal: ac.signal });
        return { k, kind, finished: true };  // it may finish first
      }
      const r = await client.completions.create({ ...endless, max_tokens: 8 + (k % 5) });
      return { k, kind, tokens: r.usage.completion_tokens };
    } catch (error) {
      return { k, kind, error };
    }
  }));
  await watch;
  assert.ok(sawPages, 'pages were held while the requests ran');
  for (const r of results) {
    if (r.error) {
      assert.ok(r.kind === 'abort' && (r.error instanceof OpenAI.APIUserAbortError || r.error?.name === 'AbortError'),
                `${r.kind} ${r.k}: ${r.error?.constructor?.name} ${r.error}`);
    } else if (r.kind === 'finish') {
      assert.equal(r.tokens, 8 + (r.k % 5));
    }
  }
  await until(async () => (await metric(srv.url, 'kvq_kv_pages_used')) === 0 &&
                          (await metric(srv.url, 'kvq_sequences_running')) === 0 &&
                          (await metric(srv.url, 'kvq_sequences_waiting')) === 0, 'every page to come back', 60);
  // Free again, or idle in the prefix cache (reclaimed when needed).
  assert.equal((await metric(srv.url, 'kvq_kv_pages_free')) + (await metric(srv.url, 'kvq_kv_pages_cached')), total);
  assert.equal(await metric(srv.url, 'kvq_kv_cache_bytes'), 0);
  const left = results.filter((r) => r.kind === 'stream-hang-up' || r.error).length;
  assert.ok((await metric(srv.url, 'kvq_requests_cancelled_total')) >= cancelled0 + left,
            'every client that left was cancelled');
  // Still serving, still exact.
  assert.equal(await run(requestOf(0), true), await run(requestOf(0), false));
  console.log(`disconnects: ${left} of ${N} clients left early; every page came back`);
});
