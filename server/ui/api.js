// The pages' one way to call the server: JSON requests to its own API (same origin), the
// key (an API or admin key) kept in this browser's localStorage only, errors turned into
// messages from the OpenAI error envelope. Shared by chat.js and dashboard.js.

const KEY = 'rlserve.key';

export function getKey() {
  return localStorage.getItem(KEY) || '';
}

export function setKey(k) {
  if (k) localStorage.setItem(KEY, k);
  else localStorage.removeItem(KEY);
}

/** An API answer that was not 2xx (status 0: no answer at all). */
export class ApiError extends Error {
  constructor(status, message, param) {
    super(message);
    this.status = status;
    this.param = param;
  }
}

async function toError(r) {
  let message = `${r.status} ${r.statusText}`;
  let param = null;
  try {
    const j = await r.json();
    if (j.error && j.error.message) message = j.error.message;
    param = j.error ? j.error.param : null;
  } catch (_) { /* not JSON */ }
  if (r.status === 401) message += ' (enter the key in the key field at the top)';
  return new ApiError(r.status, `${r.status}: ${message}`, param);
}

/** `fetch` of `path` with a JSON `body` (if any); throws ApiError unless 2xx. */
export async function call(method, path, body, signal) {
  const headers = {};
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  const k = getKey();
  if (k) headers.Authorization = `Bearer ${k}`;
  let r;
  try {
    r = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body), signal });
  } catch (e) {
    if (e.name === 'AbortError') throw e;
    throw new ApiError(0, 'the server does not answer (stopped, or unreachable)');
  }
  if (!r.ok) throw await toError(r);
  return r;
}

export async function getJson(path) {
  return (await call('GET', path)).json();
}

export async function postJson(path, body) {
  return (await call('POST', path, body)).json();
}

/** The JSON events of a server-sent-events answer, until `[DONE]`. */
export async function* events(response) {
  const reader = response.body.getReader();
  const dec = new TextDecoder();
  let buf = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let at;
    while ((at = buf.indexOf('\n\n')) >= 0) {
      const block = buf.slice(0, at);
      buf = buf.slice(at + 2);
      for (const line of block.split('\n')) {
        if (!line.startsWith('data:')) continue;
        const data = line.slice(5).trim();
        if (data === '[DONE]') return;
        const ev = JSON.parse(data);
        if (ev.error) throw new ApiError(500, `the stream ended with an error: ${ev.error.message}`);
        yield ev;
      }
    }
  }
}

/** Wires a key field (`input`) to the stored key. */
export function keyField(input, onChange) {
  input.value = getKey();
  input.addEventListener('change', () => {
    setKey(input.value.trim());
    if (onChange) onChange();
  });
}

/** Shows `text` in the page's notice line (`kind`: error or info), cleared after a while. */
export function notice(text, kind = 'error') {
  const el = document.getElementById('notice');
  el.textContent = text;
  el.className = `notice ${kind}`;
  el.hidden = !text;
  clearTimeout(notice.timer);
  if (text && kind === 'info') notice.timer = setTimeout(() => { el.hidden = true; }, 4000);
}
