// A bounded load test on loopback: bursts of concurrent OpenAI clients, some
// hanging up mid-stream or while queued, against a server with a small
// queue. Every request must end with the right answer (greedy, so known in
// advance), a 429 for the full queue, or the client's own abort; afterwards
// the server is idle, has freed every cache, and still answers.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { loadOpenAI, startServer, metric, until, MODEL } from './kvq_server.mjs';

const OpenAI = await loadOpenAI();
const MAX_QUEUE = 6;
const N_TOKENS = 12;
let srv, client;

before(async () => {
  // One running place (--max-seqs 1): the burst below then meets a known
  // number of free places (batching itself is batch.test.mjs's).
  srv = await startServer(['--ctx', '1024', '--max-seqs', '1', '--max-queue', String(MAX_QUEUE)]);
  client = new OpenAI({ baseURL: srv.baseURL, apiKey: 'unused', maxRetries: 0, timeout: 120_000 });
});

after(async () => {
  assert.ok(srv.alive(), 'the server survived the load');
  assert.equal(await srv.stop(), 0);
});

// Chat prompts the tiny code model answers with text (code-like ones often end at once).
const prompts = ['Write a Python function that reverses a string.', 'Sort a list in Python', 'How do I read a file?',
                 'import os\nimport sys\n'];
const chatBody = (i) => ({ model: MODEL, messages: [{ role: 'user', content: prompts[i] }], max_tokens: N_TOKENS, temperature: 0 });
// Greedy repeats this line for thousands of tokens: such a request runs until its client hangs up.
const endless = { model: MODEL, prompt: 'x = 1\nx = 1\nx = 1\n', max_tokens: 900, temperature: 0, stream: true };

async function chat(i, stream, options = {}) {
  if (!stream) return (await client.chat.completions.create(chatBody(i), options)).choices[0].message.content;
  let text = '';
  for await (const c of await client.chat.completions.create({ ...chatBody(i), stream: true }, options)) {
    text += c.choices[0]?.delta?.content ?? '';
  }
  return text;
}

// Starts an endless stream and resolves once text arrives (it is then decoding);
// hangUp() closes it.
async function endlessStream() {
  const stream = await client.completions.create(endless);
  const it = stream[Symbol.asyncIterator]();
  for (;;) {
    const { value } = await it.next();
    if (value.choices[0]?.text) break;
  }
  return { hangUp: () => it.return() };
}

// The SDK reports an abort before the response as APIUserAbortError, one while
// reading the body as fetch's AbortError.
const isOwnAbort = (e) => e instanceof OpenAI.APIUserAbortError || e?.name === 'AbortError';
const isQueueFull = (e) => e instanceof OpenAI.RateLimitError && e.status === 429 && e.code === 'queue_full';

test('load: bursts, a full queue and disconnects', async () => {
  const want = [];
  for (let i = 0; i < prompts.length; i++) want.push(await chat(i, false));
  assert.ok(want.every((t) => t.length > 0));
  const cancelledBefore = await metric(srv.url, 'kvq_requests_cancelled_total');

  // 1. A burst of 40 while one request decodes: MAX_QUEUE wait, the rest are
  // turned away at once; the waiting ones are answered in turn.
  const blocker = await endlessStream();
  const outcomes = Array(40).fill(null);
  const burst = outcomes.map((_, k) =>
    chat(k % prompts.length, k % 2 === 1).then(
      (text) => (outcomes[k] = { k, text }),
      (error) => (outcomes[k] = { k, error })));
  await until(async () => outcomes.filter((o) => o && isQueueFull(o.error)).length === 40 - MAX_QUEUE &&
                          (await metric(srv.url, 'kvq_queue_depth')) === MAX_QUEUE,
              'the queue to fill and the rest to be refused');
  blocker.hangUp();
  await Promise.all(burst);
  let answered = 0;
  for (const o of outcomes) {
    if (o.error) {
      assert.ok(isQueueFull(o.error), `request ${o.k}: ${o.error}`);
    } else {
      assert.equal(o.text, want[o.k % prompts.length], `request ${o.k}`);
      answered++;
    }
  }
  assert.equal(answered, MAX_QUEUE);

  // 2. Chaos: 32 clients arriving 20 ms apart; some hang up mid-stream, some
  // abort while waiting, the rest want answers. Each gets its answer, a 429,
  // or its own abort.
  const results = await Promise.all(Array.from({ length: 32 }, async (_, k) => {
    const kind = ['answer', 'stream', 'hang-up', 'abort-waiting'][k % 4];
    await new Promise((r) => setTimeout(r, 20 * k));
    try {
      if (kind === 'hang-up') {
        (await endlessStream()).hangUp();
        return { k, kind, hungUp: true };
      }
      if (kind === 'abort-waiting') {
        const ac = new AbortController();
        setTimeout(() => ac.abort(), 100);
        return { k, kind, text: await chat(k % prompts.length, false, { signal: ac.signal }) };
      }
      return { k, kind, text: await chat(k % prompts.length, kind === 'stream') };
    } catch (error) {
      return { k, kind, error };
    }
  }));
  let hungUp = 0;
  for (const r of results) {
    if (r.error) {
      // An abort can also cut the reading of a 429's body short (then its code is lost).
      const ok = isQueueFull(r.error) || (r.kind === 'abort-waiting' && (isOwnAbort(r.error) ||
                 (r.error instanceof OpenAI.RateLimitError && r.error.status === 429)));
      assert.ok(ok, `${r.kind} ${r.k}: ${r.error?.constructor?.name} ${r.error}`);
    } else if (r.hungUp) {
      hungUp++;
    } else {
      assert.equal(r.text, want[r.k % prompts.length], `${r.kind} ${r.k}`);
    }
  }

  // 3. Idle again: nothing queued or running, every cache freed, every
  // decoding request whose client left was cancelled, and it still answers.
  await until(async () => (await metric(srv.url, 'kvq_queue_depth')) === 0 &&
                          (await metric(srv.url, 'kvq_requests_running')) === 0 &&
                          (await metric(srv.url, 'kvq_kv_cache_bytes')) === 0, 'the server to be idle');
  assert.ok((await metric(srv.url, 'kvq_requests_cancelled_total')) >= cancelledBefore + 1 + hungUp);
  const health = await fetch(`${srv.url}/health`);
  assert.equal(health.status, 200);
  assert.equal(await chat(0, true), want[0]);
  console.log(`load: burst answered ${answered}, refused ${40 - answered}; chaos: ` +
              `${results.filter((r) => r.text !== undefined).length} answered, ${hungUp} hung up mid-stream, ` +
              `${results.filter((r) => r.error && isQueueFull(r.error)).length} refused, ` +
              `${results.filter((r) => isOwnAbort(r.error)).length} aborted while waiting`);
});
