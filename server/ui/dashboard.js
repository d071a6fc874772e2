// The live dashboard: the engine's load from /v1/status sampled every 2 s (rates from two
// readings of its counters), and per training job (the feedback learner included, as job
// `feedback`) its step records from /v1/train/jobs/{id} as uPlot charts; jobs are started
// from a pasted JSON config and stopped from the table.
import uPlot from '/ui/vendor/uplot-1.6.32/uPlot.esm.js';
import { getJson, postJson, keyField, notice } from '/ui/api.js';

const $ = (id) => document.getElementById(id);
const WINDOW_S = 600;

/** Three charts a row on a wide window, one on a phone. */
function width(container) {
  const w = container.clientWidth;
  return w < 700 ? w - 10 : Math.floor((w - 36) / 3) - 10;
}

/** A chart of `series` ({label, unit, stroke}) over x (time in s, or step), in `parent`. */
function chart(parent, key, title, xLabel, series, time) {
  const box = document.createElement('div');
  box.className = 'chart';
  box.dataset.chart = key;
  box.dataset.points = '0';
  parent.append(box);
  const unit = series[0].unit;
  const opts = {
    title,
    width: width(parent),
    height: 180,
    scales: { x: { time } },
    // Steps are whole numbers; values keep 3 significant digits (a loss of 1e-4 is not "-0").
    axes: [
      // A 10-minute window needs no date: wall-clock times, spaced so that they never overlap.
      time
        ? { label: xLabel, space: 80, values: (_, ticks) => ticks.map((t) => new Date(t * 1000).toLocaleTimeString([], { hour: '2-digit', minute: '2-digit', second: '2-digit', hour12: false })) }
        : { label: xLabel, incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000] },
      { label: unit, size: 64, values: (_, ticks) => ticks.map((v) => (v === 0 ? '0' : String(+v.toPrecision(3)))) },
    ],
    series: [{ label: xLabel }, ...series.map((s) => ({ label: s.label, stroke: s.stroke, width: 1.5, points: { show: false } }))],
  };
  const plot = new uPlot(opts, [[], ...series.map(() => [])], box);
  return {
    set(data) {
      plot.setData(data);
      box.dataset.points = String(data[0].length);
    },
  };
}

// ---- engine ----
const engineData = { t: [], running: [], waiting: [], kv: [], prompt: [], gen: [] };
let engineCharts = null;
let last = null;

function engineInit() {
  const p = $('engine-charts');
  engineCharts = {
    reqs: chart(p, 'requests', 'Requests', 'time', [
      { label: 'running', unit: 'requests', stroke: '#2563eb' },
      { label: 'waiting', unit: 'requests', stroke: '#dc2626' },
    ], true),
    kv: chart(p, 'kv', 'KV cache usage', 'time', [{ label: 'KV cache used', unit: '% of blocks', stroke: '#7c3aed' }], true),
    tps: chart(p, 'tokens', 'Throughput', 'time', [
      { label: 'prompt', unit: 'tokens/s', stroke: '#059669' },
      { label: 'generation', unit: 'tokens/s', stroke: '#d97706' },
    ], true),
  };
}

function engineSample(s) {
  const e = s.engine;
  if (!e || (last && s.time <= last.time)) return;
  const d = engineData;
  const rate = (now, prev) => (last ? Math.max(0, now - prev) / Math.max(1e-3, s.time - last.time) : 0);
  d.t.push(s.time);
  d.running.push(e.num_requests_running);
  d.waiting.push(e.num_requests_waiting);
  d.kv.push(100 * e.kv_cache_usage);
  d.prompt.push(rate(e.prompt_tokens_total, last && last.engine.prompt_tokens_total));
  d.gen.push(rate(e.generation_tokens_total, last && last.engine.generation_tokens_total));
  while (d.t.length && d.t[0] < s.time - WINDOW_S) for (const k in d) d[k].shift();
  last = s;
  engineCharts.reqs.set([d.t, d.running, d.waiting]);
  engineCharts.kv.set([d.t, d.kv]);
  engineCharts.tps.set([d.t, d.prompt, d.gen]);
}

// ---- training ----
// Per chart: the step record's fields (TRL names) and their unit.
const JOB_CHARTS = [
  ['reward', 'Reward', 'reward', [['reward', 'mean reward', '#059669']]],
  ['loss', 'Loss', 'loss', [['loss', 'loss', '#2563eb']]],
  ['kl', 'KL to the initial policy', 'nats/token', [['kl_to_initial', 'KL(π ‖ π₀)', '#7c3aed']]],
  ['entropy', 'Entropy', 'nats/token', [['entropy', 'entropy', '#d97706']]],
  ['clip', 'Clip fraction', 'fraction of tokens', [['clip_ratio', 'clipped', '#dc2626']]],
  ['grad_norm', 'Gradient norm (before clipping)', 'L2 norm', [['grad_norm', 'grad norm', '#0891b2']]],
  ['mismatch', 'Mismatch ℓ vs μ', 'nats/token', [['mismatch_mean', 'mean |ℓ − μ|', '#4b5563'], ['mismatch_max', 'max |ℓ − μ|', '#9ca3af']]],
  ['staleness', 'Staleness', 'policy versions', [['staleness_mean', 'mean', '#2563eb'], ['staleness_max', 'max', '#93c5fd']]],
  ['pause', 'Engine pause per update', 'ms', [['pause_seconds', 'pause', '#b91c1c', 1000]]],
];
let selected = null;
let jobCharts = null;

function jobChartsInit() {
  const p = $('job-charts');
  p.replaceChildren();
  jobCharts = JOB_CHARTS.map(([key, title, unit, fields]) => ({
    fields,
    chart: chart(p, key, title, 'step', fields.map(([, label, stroke]) => ({ label, unit, stroke })), false),
  }));
}

function showJob(st) {
  $('job').hidden = false;
  const of = st.max_steps ? ` of ${st.max_steps}` : '';
  $('job-title').textContent = `${st.id}: ${st.status}, step ${st.step}${of}, policy v${st.version}${st.error ? ` — ${st.error}` : ''}`;
  const h = st.history || [];
  const steps = h.map((r) => r.step);
  for (const { fields, chart: c } of jobCharts) {
    c.set([steps, ...fields.map(([f, , , scale]) => h.map((r) => (r[f] === undefined || r[f] === null ? null : r[f] * (scale || 1))))]);
  }
  $('alarm').hidden = !(st.latest && st.latest.entropy_collapse);
}

async function select(id) {
  if (selected !== id) {
    selected = id;
    jobChartsInit();
  }
  try {
    showJob(await getJson(`/v1/train/jobs/${encodeURIComponent(id)}`));
  } catch (e) {
    notice(`job ${id}: ${e.message}`);
  }
}

async function stop(id) {
  try {
    await postJson(`/v1/train/jobs/${encodeURIComponent(id)}/stop`, {});
    notice(`asked ${id} to stop after its current step`, 'info');
    refreshJobs();
  } catch (e) {
    notice(`stopping ${id}: ${e.message}`);
  }
}

async function refreshJobs() {
  const body = $('jobs').querySelector('tbody');
  let list;
  try {
    list = (await getJson('/v1/train/jobs')).data;
  } catch (e) {
    body.replaceChildren();
    const row = body.insertRow();
    const cell = row.insertCell();
    cell.colSpan = 5;
    cell.className = 'error';
    cell.textContent = `jobs unavailable: ${e.message}`;
    return;
  }
  body.replaceChildren();
  for (const j of list) {
    const row = body.insertRow();
    row.dataset.job = j.id;
    row.className = j.id === selected ? 'selected' : '';
    row.addEventListener('click', () => select(j.id));
    for (const v of [j.id, j.status, j.max_steps ? `${j.step} / ${j.max_steps}` : `${j.step}`, `v${j.version}`]) {
      row.insertCell().textContent = v;
    }
    const cell = row.insertCell();
    if ((j.status === 'running') && j.id !== 'feedback') {
      const b = document.createElement('button');
      b.type = 'button';
      b.textContent = 'Stop';
      b.className = 'stop-job';
      b.addEventListener('click', (e) => { e.stopPropagation(); stop(j.id); });
      cell.append(b);
    }
  }
  if (!list.length) {
    const cell = body.insertRow().insertCell();
    cell.colSpan = 5;
    cell.textContent = 'no training job yet';
  }
  if (selected) select(selected);
  else if (list.length) select(list[0].id);
}

async function startJob() {
  let config;
  try {
    config = JSON.parse($('config').value);
  } catch (e) {
    notice(`the config is not JSON: ${e.message}`);
    return;
  }
  try {
    const j = await postJson('/v1/train/jobs', config);
    notice(`started ${j.id}`, 'info');
    selected = null;
    await select(j.id);
    refreshJobs();
  } catch (e) {
    notice(`the job did not start: ${e.message}`);
  }
}

async function tick() {
  try {
    const s = await getJson('/v1/status');
    $('status').textContent = `${s.model} · policy v${s.version}` + (s.feedback ? ` · feedback: ${s.feedback.ready} rated samples waiting (of ${s.feedback.batch_size}), ${s.feedback.trained} trained` : '');
    $('status').className = 'status';
    engineSample(s);
  } catch (e) {
    $('status').textContent = `status unavailable: ${e.message}`;
    $('status').className = 'status error';
  }
  refreshJobs();
}

// The charts open on the server's samples of the last 10 minutes, then go on live.
async function start() {
  engineInit();
  try {
    for (const s of (await getJson('/v1/status/history')).data) engineSample(s);
  } catch (e) {
    notice(`the engine's history is unavailable: ${e.message}`);
  }
  keyField($('key'), tick);
  $('start-job').addEventListener('click', startJob);
  tick();
  setInterval(tick, 2000);
}

start();
