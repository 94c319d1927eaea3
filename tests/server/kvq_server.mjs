// Starts `kvq serve` ($KVQ_BIN, set by ctest) on a free loopback port and
// loads the openai npm package (installed by `npm ci` here; tools/install-deps.sh does it).
import { spawn } from 'node:child_process';

export async function loadOpenAI() {
  try {
    return (await import('openai')).default;
  } catch (e) {
    throw new Error(`the openai npm package is not installed: run \`npm ci\` in tests/server ` +
                    `(tools/install-deps.sh does it): ${e.message}`);
  }
}

export const MODEL = 'kvq-tiny-code';

// Resolves once the server prints its port; stop() sends SIGTERM and resolves to the exit code.
export async function startServer(args = []) {
  const bin = process.env.KVQ_BIN;
  if (!bin) throw new Error('set KVQ_BIN to the kvq binary (ctest does)');
  // One compute thread: ctest runs other suites beside this one on small machines.
  const child = spawn(bin, ['serve', '--port', '0', '-t', '1', ...args], { stdio: ['ignore', 'ignore', 'pipe'] });
  let log = '';
  const exited = new Promise((resolve) => child.on('exit', (code, signal) => resolve(code ?? signal)));
  const port = await new Promise((resolve, reject) => {
    child.stderr.on('data', (d) => {  // keep reading: a full pipe would block the server
      log += d;
      const m = log.match(/listening on http:\/\/127\.0\.0\.1:(\d+)/);
      if (m) resolve(Number(m[1]));
    });
    exited.then((code) => reject(new Error(`kvq serve exited (${code}) before listening:\n${log}`)));
  });
  const url = `http://127.0.0.1:${port}`;
  return {
    url,
    baseURL: `${url}/v1`,
    log: () => log,
    alive: () => child.exitCode === null && child.signalCode === null,
    async stop() {
      child.kill('SIGTERM');
      return exited;
    },
    kill: (sig) => child.kill(sig),
    exited,
  };
}

// The value of an unlabelled Prometheus metric.
export async function metric(url, name) {
  const text = await (await fetch(`${url}/metrics`)).text();
  const m = text.match(new RegExp(`^${name} (\\S+)$`, 'm'));
  if (!m) throw new Error(`no metric ${name} in:\n${text}`);
  return Number(m[1]);
}

// Polls until pred() is true (bounded, so a stuck server fails the test).
export async function until(pred, what, seconds = 60) {
  const end = Date.now() + seconds * 1000;
  while (Date.now() < end) {
    if (await pred()) return;
    await new Promise((r) => setTimeout(r, 50));
  }
  throw new Error(`timed out waiting for ${what}`);
}
