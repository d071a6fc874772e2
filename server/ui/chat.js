// The chat that learns: multi-turn chat streamed from /v1/chat/completions, every answer
// with the policy version(s) that produced it (the per-token versions the server returns
// with `return_token_ids`) and thumbs up / down (reward 1 / 0 through /v1/feedback); the
// compare mode asks for two answers (n = 2) and sends the chosen / rejected pair. The
// conversation is kept in this browser (localStorage).
import { marked } from '/ui/vendor/marked-18.3.0/marked.esm.js';
import DOMPurify from '/ui/vendor/dompurify-3.5.0/purify.es.mjs';
import { call, postJson, getJson, events, keyField, notice } from '/ui/api.js';

const STORE = 'rlserve.chat';
const $ = (id) => document.getElementById(id);

// { settings: {...}, messages: [{ role, content } | { role: 'assistant', id, answers: [{ text,
//   versions: [min, max], finish, rated }], chosen, failed }] }
let state = load();
let running = null; // the AbortController of the request in flight
let status = null; // the latest /v1/status

function load() {
  try {
    const s = JSON.parse(localStorage.getItem(STORE));
    if (s && Array.isArray(s.messages)) return s;
  } catch (_) { /* start afresh */ }
  return { settings: {}, messages: [] };
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(state));
}

function markdown(text) {
  return DOMPurify.sanitize(marked.parse(text || ''));
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === 'class') e.className = v;
    else if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null && v !== false) e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

function versionLabel(v) {
  if (!v) return '';
  return v[0] === v[1] ? `policy v${v[0]}` : `policy v${v[0]}–v${v[1]}`;
}

// The text an assistant message continues the conversation with.
function chosenText(m) {
  return m.answers[m.chosen ?? 0].text;
}

function render() {
  const box = $('messages');
  box.replaceChildren();
  state.messages.forEach((m, i) => box.append(m.role === 'user' ? userView(m, i) : assistantView(m, i)));
  box.scrollTop = box.scrollHeight;
  const busy = running !== null;
  $('send').disabled = busy;
  $('stop').hidden = !busy;
}

function userView(m, i) {
  const body = el('div', { class: 'text' }, m.content);
  const edit = el('button', { type: 'button', class: 'link', title: 'edit and resend', onclick: () => editMessage(i) }, 'edit');
  return el('div', { class: 'msg user', 'data-index': i }, body, el('div', { class: 'meta' }, running ? '' : edit));
}

function assistantView(m, i) {
  const last = i === state.messages.length - 1;
  const compare = m.answers.length > 1;
  const cols = m.answers.map((a, c) => answerView(m, a, c, compare));
  const wrap = el('div', { class: compare ? 'answers compare' : 'answers' }, ...cols);
  const meta = el('div', { class: 'meta' });
  // A stopped answer says so in its own line (its finish label).
  if (m.failed && m.failed !== 'stopped') meta.append(el('span', { class: 'error' }, m.failed));
  if (last && !running) {
    meta.append(el('button', { type: 'button', class: 'link', onclick: regenerate }, 'regenerate'));
  }
  return el('div', { class: 'msg assistant', 'data-id': m.id || '', 'data-index': i }, wrap, meta);
}

function answerView(m, a, c, compare) {
  const body = el('div', { class: 'text markdown' });
  body.innerHTML = markdown(a.text);
  const info = el('div', { class: 'answer-meta' });
  if (a.versions) info.append(el('span', { class: 'version', 'data-version': a.versions[1] }, versionLabel(a.versions)));
  if (a.finish) info.append(el('span', { class: 'finish' }, a.finish === 'stop' ? '' : a.finish));
  const done = a.finish && m.id && !running;
  // The server keeps a response for rating once every choice has finished: a stopped or
  // failed one was never kept, so it offers no rating buttons.
  if (m.failed) {
    /* nothing to rate */
  } else if (compare) {
    const chosen = m.chosen === c;
    const btn = el('button', {
      type: 'button', class: chosen ? 'prefer chosen' : 'prefer', disabled: !done || m.chosen !== undefined,
      onclick: () => prefer(m, c),
    }, chosen ? 'preferred ✓' : `prefer ${'AB'[c]}`);
    info.append(btn);
  } else {
    const greedy = Number(state.settings.temperature ?? 0.7) < 1e-5;
    const title = greedy ? 'greedy answers (temperature 0) cannot be rated' : undefined;
    for (const [reward, label, name] of [[1, '▲ good', 'up'], [0, '▼ bad', 'down']]) {
      info.append(el('button', {
        type: 'button', class: a.rated === reward ? `rate ${name} rated` : `rate ${name}`, title,
        'aria-label': `thumbs ${name}`, disabled: !done || a.rated !== undefined || greedy || !feedbackOn(),
        onclick: () => rate(m, c, reward),
      }, label));
    }
  }
  return el('div', { class: compare ? `answer col${c}` : 'answer' }, compare ? el('div', { class: 'label' }, `Answer ${'AB'[c]}`) : '', body, info);
}

function feedbackOn() {
  return status === null || status.feedback !== null;
}

async function rate(m, c, reward) {
  try {
    await postJson('/v1/feedback', { id: m.id, choice: c, reward });
    m.answers[c].rated = reward;
    save();
    notice(`rating sent: ${reward ? 'thumbs up' : 'thumbs down'}`, 'info');
    refreshStatus();
  } catch (e) {
    notice(`rating not sent: ${e.message}`);
  }
  render();
}

async function prefer(m, c) {
  try {
    await postJson('/v1/feedback', { id: m.id, chosen: c, rejected: 1 - c });
    m.chosen = c;
    save();
    notice(`preference sent: answer ${'AB'[c]} over ${'AB'[1 - c]}`, 'info');
    refreshStatus();
  } catch (e) {
    notice(`preference not sent: ${e.message}`);
  }
  render();
}

function settings() {
  const s = state.settings;
  s.system = $('system').value;
  s.temperature = $('temperature').value;
  s.top_p = $('top_p').value;
  s.max_tokens = $('max_tokens').value;
  s.compare = $('compare').checked;
  save();
  return s;
}

function history() {
  const s = state.settings;
  const msgs = [];
  if (s.system && s.system.trim()) msgs.push({ role: 'system', content: s.system });
  for (const m of state.messages) {
    if (m.role === 'user') msgs.push({ role: 'user', content: m.content });
    else if (!m.failed || m.answers.some((a) => a.text)) msgs.push({ role: 'assistant', content: chosenText(m) });
  }
  return msgs;
}

async function generate() {
  const s = settings();
  const n = s.compare ? 2 : 1;
  const body = {
    model: status ? status.model : undefined,
    messages: history(),
    stream: true,
    stream_options: { include_usage: true },
    return_token_ids: true,
    n,
    temperature: Number(s.temperature),
    top_p: Number(s.top_p),
    max_tokens: Number(s.max_tokens),
  };
  const m = { role: 'assistant', answers: Array.from({ length: n }, () => ({ text: '' })) };
  state.messages.push(m);
  notice(''); // an earlier answer's error is not this one's
  running = new AbortController();
  render();
  try {
    const r = await call('POST', '/v1/chat/completions', body, running.signal);
    for await (const ev of events(r)) {
      m.id = ev.id;
      for (const ch of ev.choices || []) {
        const a = m.answers[ch.index];
        if (!a) continue;
        a.text += (ch.delta && ch.delta.content) || '';
        for (const v of ch.versions || []) {
          a.versions = a.versions ? [Math.min(a.versions[0], v), Math.max(a.versions[1], v)] : [v, v];
        }
        if (ch.finish_reason) a.finish = ch.finish_reason;
      }
      render();
    }
  } catch (e) {
    if (e.name === 'AbortError') {
      m.failed = 'stopped';
      for (const a of m.answers) a.finish = a.finish || 'stopped';
    } else {
      m.failed = e.message;
      notice(`the answer failed: ${e.message}`);
    }
  }
  running = null;
  save();
  render();
}

function send(text) {
  if (running || !text.trim()) return;
  state.messages.push({ role: 'user', content: text });
  generate();
}

function regenerate() {
  if (running) return;
  const last = state.messages[state.messages.length - 1];
  if (last && last.role === 'assistant') state.messages.pop();
  generate();
}

function editMessage(i) {
  if (running) return;
  const m = state.messages[i];
  const box = document.querySelector(`.msg.user[data-index="${i}"]`);
  const area = el('textarea', { rows: 3 });
  area.value = m.content;
  const resend = el('button', { type: 'button', onclick: () => {
    if (!area.value.trim()) return;
    state.messages = state.messages.slice(0, i);
    send(area.value);
  } }, 'Resend');
  const cancel = el('button', { type: 'button', onclick: render }, 'Cancel');
  box.replaceChildren(area, el('div', { class: 'meta' }, resend, cancel));
  area.focus();
}

async function refreshStatus() {
  const line = $('status');
  try {
    const s = await getJson('/v1/status');
    const changed = status && status.version !== s.version;
    status = s;
    let text = `${s.model} · policy v${s.version}`;
    if (s.feedback) {
      text += ` · ${s.feedback.ready} rated samples waiting for the next update (of ${s.feedback.batch_size}) · ${s.feedback.trained} trained`;
    } else {
      text += ' · feedback learning is off (start the server with --learn-from-feedback to rate answers)';
    }
    if (s.feedback && !s.admin_enabled) text += ' · rating is disabled: the server needs --admin-key';
    else if (s.feedback && s.admin_key_required && !$('key').value) text += ' · ratings need the admin key (field on the right)';
    line.textContent = text;
    line.dataset.version = s.version;
    line.className = changed ? 'status changed' : 'status';
    line.classList.toggle('off', !s.feedback);
  } catch (e) {
    status = null;
    line.textContent = `status unavailable: ${e.message}`;
    line.className = 'status error';
  }
}

function init() {
  const s = state.settings;
  if (s.system !== undefined) $('system').value = s.system;
  if (s.temperature !== undefined) $('temperature').value = s.temperature;
  if (s.top_p !== undefined) $('top_p').value = s.top_p;
  if (s.max_tokens !== undefined) $('max_tokens').value = s.max_tokens;
  $('compare').checked = !!s.compare;
  for (const id of ['system', 'temperature', 'top_p', 'max_tokens', 'compare']) {
    $(id).addEventListener('change', () => { settings(); render(); });
  }
  keyField($('key'), refreshStatus);
  $('composer').addEventListener('submit', (e) => {
    e.preventDefault();
    const text = $('input').value;
    $('input').value = '';
    send(text);
  });
  $('input').addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey) {
      e.preventDefault();
      $('composer').requestSubmit();
    }
  });
  $('stop').addEventListener('click', () => running && running.abort());
  $('clear').addEventListener('click', () => {
    if (running) return;
    state.messages = [];
    save();
    render();
  });
  render();
  refreshStatus();
  setInterval(refreshStatus, 2000);
}

init();
