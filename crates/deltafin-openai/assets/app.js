// The chat page of `deltafin serve` (docs/SERVER.md "The chat page").
//
// It speaks the server's own API from the same origin: `POST /v1/chat/completions` with
// `stream: true` (read with fetch and a stream reader: the prefill's progress arrives as SSE
// comment lines `: prefill i/n`, the answer as `data:` frames), `GET /v1/status` for what K3
// is doing, `GET /v1/benchmark` for the last benchmark. Conversations, settings and the API
// key stay in this browser (localStorage). Model text enters the page only as text nodes, or
// as markdown rendered by marked and sanitized by DOMPurify through the one Trusted Types
// policy the page's Content-Security-Policy allows.
'use strict';

(() => {
  const STORE = {
    conversations: 'deltafin.conversations.v1',
    current: 'deltafin.current.v1',
    settings: 'deltafin.settings.v1',
    key: 'deltafin.apiKey',
  };
  const MODEL = 'deltafin-kimi-k3';
  // What the page's Content-Security-Policy blocked (none is expected; the page's test
  // reads this list).
  window.deltafinViolations = [];
  document.addEventListener('securitypolicyviolation', (e) => {
    window.deltafinViolations.push(`${e.violatedDirective}: ${e.blockedURI} at ${e.sourceFile}:${e.lineNumber} (${e.sample})`);
  });
  // The page's own failures are shown, not swallowed (and read by its test).
  window.deltafinErrors = [];
  const failed = (what) => {
    window.deltafinErrors.push(what);
    showNotice(`The page failed: ${what}`, 'error');
  };
  window.addEventListener('error', (e) => failed(String(e.message)));
  window.addEventListener('unhandledrejection', (e) => failed(String(e.reason && e.reason.stack ? e.reason.stack : e.reason)));
  const POLL_IDLE_MS = 2000;
  const POLL_BUSY_MS = 400;
  const $ = (id) => document.getElementById(id);

  // ---------------------------------------------------------------------------------------
  // HTML: markdown through marked, sanitized by DOMPurify, through a Trusted Types policy.

  const PURIFY = {
    USE_PROFILES: { html: true },
    FORBID_TAGS: ['style', 'img', 'form', 'input', 'button', 'textarea', 'select', 'iframe'],
    FORBID_ATTR: ['style'],
  };
  DOMPurify.addHook('afterSanitizeAttributes', (node) => {
    if (node.tagName === 'A') {
      node.setAttribute('target', '_blank');
      node.setAttribute('rel', 'noopener noreferrer');
    }
  });
  const sanitize = (html) => DOMPurify.sanitize(html, PURIFY);
  const htmlPolicy = window.trustedTypes
    ? window.trustedTypes.createPolicy('deltafin', { createHTML: sanitize })
    : { createHTML: sanitize };

  function renderMarkdown(el, text) {
    el.innerHTML = htmlPolicy.createHTML(marked.parse(text, { gfm: true, breaks: false, async: false }));
    for (const pre of el.querySelectorAll('pre')) {
      const b = document.createElement('button');
      b.className = 'copy';
      b.type = 'button';
      b.textContent = 'Copy';
      b.addEventListener('click', () => copyText(pre.querySelector('code')?.textContent ?? pre.textContent));
      pre.appendChild(b);
    }
  }

  function copyText(text) {
    if (navigator.clipboard) navigator.clipboard.writeText(text).catch(() => {});
  }

  // ---------------------------------------------------------------------------------------
  // Storage.

  function load(key, fallback) {
    try {
      const v = localStorage.getItem(key);
      return v === null ? fallback : JSON.parse(v);
    } catch {
      return fallback;
    }
  }

  function save(key, value) {
    try {
      localStorage.setItem(key, JSON.stringify(value));
      return true;
    } catch (e) {
      showNotice(`Could not save in this browser's storage (${e.name}): delete old conversations.`, 'error');
      return false;
    }
  }

  const newId = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 10);

  let conversations = load(STORE.conversations, []);
  if (!Array.isArray(conversations)) conversations = [];
  let currentId = load(STORE.current, null);
  let apiKey = localStorage.getItem(STORE.key) || '';

  function current() {
    return conversations.find((c) => c.id === currentId) || null;
  }

  function persist() {
    save(STORE.conversations, conversations);
    save(STORE.current, currentId);
  }

  let persistTimer = null;
  function persistSoon() {
    if (persistTimer) return;
    persistTimer = setTimeout(() => {
      persistTimer = null;
      persist();
    }, 1000);
  }

  // ---------------------------------------------------------------------------------------
  // Settings.

  const SETTING_IDS = ['effort', 'temperature', 'top_p', 'top_k', 'min_p', 'seed', 'max_tokens', 'system', 'tools', 'tool_choice'];

  function loadSettings() {
    const s = load(STORE.settings, {});
    for (const id of SETTING_IDS) if (typeof s[id] === 'string') $(id).value = s[id];
  }

  function saveSettings() {
    const s = {};
    for (const id of SETTING_IDS) s[id] = $(id).value;
    save(STORE.settings, s);
  }

  // The request fields the settings ask for, or an error naming the bad one.
  function settingsFields() {
    const out = {};
    const effort = $('effort').value;
    if (effort) out.reasoning_effort = effort;
    const num = (id, integer) => {
      const raw = $(id).value.trim();
      if (raw === '') return undefined;
      const v = Number(raw);
      if (!Number.isFinite(v) || (integer && !Number.isInteger(v))) throw new Error(`${id} must be ${integer ? 'an integer' : 'a number'}`);
      return v;
    };
    for (const [id, integer] of [['temperature', false], ['top_p', false], ['top_k', true], ['min_p', false], ['seed', true], ['max_tokens', true]]) {
      const v = num(id, integer);
      if (v !== undefined) out[id] = v;
    }
    const tools = $('tools').value.trim();
    if (tools) {
      let parsed;
      try {
        parsed = JSON.parse(tools);
      } catch (e) {
        throw new Error(`tools is not JSON: ${e.message}`);
      }
      if (!Array.isArray(parsed)) throw new Error('tools must be a JSON array of function tools');
      out.tools = parsed;
      if ($('tool_choice').value) out.tool_choice = $('tool_choice').value;
    }
    return out;
  }

  // ---------------------------------------------------------------------------------------
  // Notices: queued, refused, failed.

  function showNotice(text, kind) {
    const n = $('notice');
    n.textContent = text;
    n.className = kind === 'error' ? 'error' : '';
    n.hidden = false;
  }

  function hideNotice() {
    $('notice').hidden = true;
  }

  // A refusal in words: its status, its code and the server's message.
  function refusalText(status, body) {
    const e = (body && body.error) || {};
    const code = e.code || e.type || 'error';
    const msg = e.message || '(no message)';
    const param = e.param ? ` (param: ${e.param})` : '';
    const why = {
      429: 'Refused: the server runs one generation at a time and no queue place was free. Retry when it is idle.',
      503: 'Refused: the server cannot serve now.',
      400: 'Refused: the server found the request invalid.',
      413: 'Refused: the conversation is larger than the server accepts (--max-request-bytes).',
      401: 'Refused: the API key is missing or wrong.',
      403: 'Refused: this page may not use the server.',
    }[status] || 'The server answered with an error.';
    return `${why} HTTP ${status} ${code}: ${msg}${param}`;
  }

  // ---------------------------------------------------------------------------------------
  // The API key: asked once, kept in this browser, sent as a bearer token.

  let keyWaiters = [];
  function askKey(message) {
    $('key-error').hidden = !message;
    $('key-error').textContent = message || '';
    $('key-input').value = '';
    const d = $('key-dialog');
    if (!d.open) d.showModal();
    $('key-input').focus();
    return new Promise((resolve) => keyWaiters.push(resolve));
  }

  function saveKey() {
    const k = $('key-input').value.trim();
    if (!k) {
      $('key-error').hidden = false;
      $('key-error').textContent = 'Enter the key the server was started with.';
      return;
    }
    apiKey = k;
    localStorage.setItem(STORE.key, k);
    $('key-dialog').close();
    // The focus Chromium gives back to the composer on close takes no typing until it is
    // given again.
    $('input').blur();
    $('input').focus();
    $('forget-key').hidden = false;
    const w = keyWaiters;
    keyWaiters = [];
    for (const r of w) r();
  }

  function headers(json) {
    const h = {};
    if (json) h['Content-Type'] = 'application/json';
    if (apiKey) h.Authorization = `Bearer ${apiKey}`;
    return h;
  }

  // fetch with the key; a 401 asks for the key and tries again.
  async function api(path, init = {}) {
    for (;;) {
      const resp = await fetch(path, { ...init, headers: headers(init.body !== undefined), cache: 'no-store' });
      if (resp.status !== 401) return resp;
      await askKey(apiKey ? 'The server refused that key.' : '');
    }
  }

  // ---------------------------------------------------------------------------------------
  // Live status from GET /v1/status.

  let lastStatus = null;
  let pollTimer = null;
  const gen = {
    running: false,
    controller: null,
    phase: 'idle',
    prefill: null, // {done, total, firstDone, firstAt, lastAt}
    reused: null,
    firstTokenAt: 0,
    frames: 0,
    atHeaders: null,
    atFirstToken: null,
  };

  function fmtBytes(n) {
    if (!Number.isFinite(n)) return '–';
    const units = ['B', 'KB', 'MB', 'GB', 'TB'];
    let i = 0;
    while (n >= 1000 && i < units.length - 1) {
      n /= 1000;
      i++;
    }
    return `${n.toFixed(n >= 100 || i === 0 ? 0 : n >= 10 ? 1 : 2)} ${units[i]}`;
  }

  const fmtRate = (r) => (r > 0 ? `${r.toFixed(r >= 100 ? 0 : 1)} tok/s` : '–');
  const fmtPct = (r) => (r === null || r === undefined ? '–' : `${(r * 100).toFixed(1)}%`);

  function fmtSeconds(s) {
    if (!Number.isFinite(s) || s < 0) return '–';
    if (s < 60) return `${Math.ceil(s)} s`;
    const m = Math.floor(s / 60);
    if (m < 60) return `${m} min ${Math.round(s - m * 60)} s`;
    return `${Math.floor(m / 60)} h ${m % 60} min`;
  }

  async function pollStatus() {
    let st = null;
    try {
      const resp = await api('/v1/status');
      if (resp.ok) st = await resp.json();
      else showState('down', `status ${resp.status}`);
    } catch {
      showState('down', 'server unreachable');
    }
    if (st) {
      lastStatus = st;
      renderStatus(st);
    }
    // Whichever poll ends last schedules the next one.
    clearTimeout(pollTimer);
    pollTimer = setTimeout(pollStatus, gen.running ? POLL_BUSY_MS : POLL_IDLE_MS);
    return st;
  }

  function showState(kind, text) {
    const el = $('server-state');
    el.className = `pill ${kind}`;
    el.textContent = text;
  }

  function renderStatus(st) {
    const names = { ready: 'ready', loading: 'loading the model…', shutting_down: 'shutting down', failed: 'failed to load' };
    showState(st.state === 'ready' ? (st.slot.busy ? 'busy' : 'ready') : st.state === 'loading' ? 'busy' : 'down', names[st.state] || st.state);
    $('server-state').title = st.error || '';
    const slot = st.slot;
    $('slot').textContent = `${slot.busy ? 'generating' : 'slot free'} · queue ${slot.queue_depth}/${slot.queue_capacity}`;
    const m = st.model_info;
    $('model-info').textContent = m ? `${m.spine} spine · ${m.device} · context ${m.context_tokens.toLocaleString()} tokens` : '';
    // A request that has no answer yet while a generation runs and requests wait is queued.
    if (gen.running && gen.phase === 'waiting' && slot.busy && slot.queue_depth > 0) {
      showNotice(`Queued: another generation is running; this request waits for the slot (${slot.queue_depth} waiting, ${slot.queue_capacity} places).`);
    }
    if (gen.running && st.prefill && gen.phase === 'prefill') {
      gen.reused = st.prefill.reused;
      $('reused').textContent = `${st.prefill.reused.toLocaleString()} of ${st.prefill.total.toLocaleString()} tokens`;
    }
    const host = st.experts.host;
    const dev = st.experts.device;
    const cache = host || dev;
    if (!gen.running || gen.phase !== 'decode') {
      $('expert-hits').textContent = cache ? `${fmtPct(cache.hit_ratio)} hits since load${host ? '' : ' (device)'}` : 'every expert resident';
      if (!host) $('expert-bytes').textContent = cache ? '–' : 'none (resident)';
    }
    if (gen.running && gen.phase === 'decode' && host && gen.atFirstToken?.experts.host) {
      const a = gen.atFirstToken.experts.host;
      const dh = host.hits - a.hits;
      const dm = host.misses - a.misses;
      $('expert-hits').textContent = `${fmtPct(dh + dm > 0 ? dh / (dh + dm) : null)} hits this answer`;
      const secs = (performance.now() - gen.firstTokenAt) / 1000;
      const tokens = Math.max(gen.frames - 1, 0);
      $('expert-bytes').textContent = tokens > 0
        ? `≈ ${fmtBytes((host.read_bytes - a.read_bytes) / tokens)}/token · ${fmtBytes((host.read_bytes - a.read_bytes) / Math.max(secs, 1e-3))}/s`
        : '–';
    }
    renderPlan(m ? m.memory_plan : undefined);
    if (!gen.running) {
      const last = st.last_generation.decode_tokens_per_second;
      if (last > 0) $('decode-rate').textContent = `${fmtRate(last)} (last answer)`;
    }
  }

  function renderPlan(plan) {
    const bar = $('memory-bar');
    const list = $('memory-parts');
    if (plan === undefined) {
      $('memory-summary').textContent = '–';
      bar.replaceChildren();
      list.replaceChildren();
      return;
    }
    if (plan === null) {
      $('memory-summary').textContent = 'no memory budget: every expert and the whole spine mapped';
      bar.replaceChildren();
      list.replaceChildren();
      return;
    }
    const parts = [
      ['spine', plan.spine_bytes + plan.spine_buffer_bytes],
      ['decode state', plan.state_bytes],
      ['runtime', plan.runtime_bytes],
      ['scratch', plan.scratch_bytes],
      ['prefix states', plan.state_cache_bytes],
      ['expert cache', plan.expert_cache_bytes],
    ];
    $('memory-summary').textContent = `${fmtBytes(plan.budget_bytes)} budget · expert cache ${fmtBytes(plan.expert_cache_bytes)} · spine ${plan.spine_resident_layers}/${plan.spine_layers} layers resident`;
    const total = Math.max(plan.budget_bytes, 1);
    bar.replaceChildren(...parts.map(([name, bytes], i) => {
      const s = document.createElement('span');
      s.className = `p${i}`;
      s.title = `${name}: ${fmtBytes(bytes)}`;
      s.style.width = `${(100 * bytes) / total}%`;
      return s;
    }));
    list.replaceChildren(...[
      ...parts.map(([name, bytes]) => `${name}: ${fmtBytes(bytes)}`),
      `pinned experts (of the cache): ${fmtBytes(plan.pinned_bytes)}`,
      `context reserved: ${plan.context_tokens.toLocaleString()} tokens`,
      `${plan.experts.toLocaleString()} experts of ${fmtBytes(plan.expert_bytes)}`,
    ].map((t, i) => {
      const li = document.createElement('li');
      const sw = document.createElement('span');
      sw.className = i < parts.length ? `swatch p${i}` : 'swatch none';
      li.append(sw, t);
      return li;
    }));
  }

  function setPhase(phase) {
    gen.phase = phase;
    document.body.dataset.phase = phase;
  }

  function renderPrefill() {
    const p = gen.prefill;
    const bar = $('prefill-bar');
    if (!p) return;
    bar.max = Math.max(p.total, 1);
    bar.value = p.done;
    let eta = '–';
    if (p.done >= p.total) eta = 'done';
    else if (p.lastAt > p.firstAt && p.done > p.firstDone) {
      const rate = (p.done - p.firstDone) / ((p.lastAt - p.firstAt) / 1000);
      eta = `ETA ${fmtSeconds((p.total - p.done) / rate)} · ${fmtRate(rate)}`;
    }
    $('prefill-text').textContent = `${p.done.toLocaleString()} / ${p.total.toLocaleString()} tokens · ${eta}`;
  }

  // ---------------------------------------------------------------------------------------
  // Conversations and messages.

  function renderList() {
    const ul = $('conversations');
    ul.replaceChildren(...conversations.map((c) => {
      const li = document.createElement('li');
      li.dataset.id = c.id;
      if (c.id === currentId) li.className = 'current';
      const t = document.createElement('span');
      t.className = 'title';
      t.textContent = c.title || 'New chat';
      const del = document.createElement('button');
      del.type = 'button';
      del.title = 'Delete this conversation';
      del.textContent = '×';
      del.addEventListener('click', (e) => {
        e.stopPropagation();
        if (gen.running && c.id === currentId) return;
        conversations = conversations.filter((x) => x.id !== c.id);
        if (currentId === c.id) currentId = conversations[0]?.id ?? null;
        persist();
        renderAll();
      });
      li.append(t, del);
      li.addEventListener('click', () => {
        if (gen.running) return;
        currentId = c.id;
        persist();
        renderAll();
      });
      return li;
    }));
  }

  function newConversation() {
    const c = { id: newId(), title: '', created: Date.now(), messages: [] };
    conversations.unshift(c);
    currentId = c.id;
    persist();
    return c;
  }

  // The DOM of message `i` of conversation `c`; `live` keeps references for streaming.
  function messageNode(c, i) {
    const m = c.messages[i];
    const div = document.createElement('div');
    div.className = `msg ${m.role}`;
    div.dataset.index = String(i);
    const role = document.createElement('div');
    role.className = 'role';
    role.textContent = { user: 'You', assistant: 'K3', tool: `Tool result (${m.name || m.tool_call_id || ''})` }[m.role] || m.role;
    div.appendChild(role);
    const refs = { div };
    if (m.role === 'assistant') {
      const det = document.createElement('details');
      det.className = 'reasoning';
      const sum = document.createElement('summary');
      const rt = document.createElement('div');
      rt.className = 'reasoning-text';
      det.append(sum, rt);
      div.appendChild(det);
      const content = document.createElement('div');
      content.className = 'content md';
      div.appendChild(content);
      const calls = document.createElement('div');
      calls.className = 'tool-calls';
      div.appendChild(calls);
      Object.assign(refs, { det, sum, rt, content, calls });
    } else {
      const content = document.createElement('div');
      content.className = 'content plain';
      content.textContent = m.content;
      div.appendChild(content);
      refs.content = content;
    }
    const meta = document.createElement('div');
    meta.className = 'meta';
    div.appendChild(meta);
    refs.meta = meta;
    const actions = document.createElement('div');
    actions.className = 'actions';
    div.appendChild(actions);
    refs.actions = actions;
    fillMessage(c, i, refs);
    return refs;
  }

  // (Re)fills the parts of an assistant message that change while it streams.
  function fillMessage(c, i, refs) {
    const m = c.messages[i];
    if (m.role === 'assistant') {
      const r = m.reasoning || '';
      refs.det.hidden = r.length === 0;
      refs.rt.textContent = r;
      const streaming = gen.running && i === c.messages.length - 1;
      refs.sum.textContent = streaming && !m.content && !(m.tool_calls || []).length
        ? `Thinking… (${r.length.toLocaleString()} characters)`
        : `Thought (${r.length.toLocaleString()} characters)`;
      if (m.content) renderMarkdown(refs.content, m.content);
      else refs.content.replaceChildren();
      refs.calls.replaceChildren(...(m.tool_calls || []).map((tc) => toolCallNode(c, i, tc)));
    }
    refs.meta.className = m.error ? 'meta error' : 'meta';
    refs.meta.textContent = metaText(m);
    fillActions(c, i, refs);
  }

  function metaText(m) {
    const bits = [];
    if (m.error) bits.push(m.error);
    if (m.finish) bits.push(m.finish === 'stopped' ? 'stopped' : `finish: ${m.finish}`);
    if (m.usage) bits.push(`${m.usage.prompt_tokens} prompt + ${m.usage.completion_tokens} completion tokens`);
    const s = m.stats;
    if (s) {
      if (s.reused !== null && s.reused !== undefined) bits.push(`${s.reused} prefix tokens reused`);
      if (s.prefill_seconds !== undefined) bits.push(`prefill ${s.prefill_seconds.toFixed(2)} s`);
      if (s.decode_tps > 0) bits.push(`decode ${fmtRate(s.decode_tps)}`);
      if (s.hit_ratio !== undefined && s.hit_ratio !== null) bits.push(`expert hits ${fmtPct(s.hit_ratio)}`);
      if (s.bytes_per_token !== undefined && s.bytes_per_token !== null) bits.push(`${fmtBytes(s.bytes_per_token)} read/token`);
    }
    return bits.join(' · ');
  }

  function toolCallNode(c, i, tc) {
    const box = document.createElement('div');
    box.className = 'tool-call';
    const name = document.createElement('div');
    name.className = 'name';
    name.textContent = `→ ${tc.function?.name || '(unnamed)'}  ${tc.id || ''}`;
    const args = document.createElement('pre');
    args.textContent = tc.function?.arguments || '';
    box.append(name, args);
    const answered = c.messages.some((x) => x.role === 'tool' && x.tool_call_id === tc.id);
    const last = !gen.running && c.messages[i].finish === 'tool_calls' && !answered;
    if (last && tc.id) {
      const ta = document.createElement('textarea');
      ta.rows = 2;
      ta.placeholder = 'The tool\'s result, sent back to K3';
      const b = document.createElement('button');
      b.type = 'button';
      b.textContent = 'Send result';
      b.addEventListener('click', () => {
        c.messages.push({ role: 'tool', tool_call_id: tc.id, name: tc.function?.name, content: ta.value });
        const calls = c.messages[i].tool_calls || [];
        const done = calls.every((t) => c.messages.some((x) => x.role === 'tool' && x.tool_call_id === t.id));
        persist();
        if (done) generate(c);
        else renderMessages();
      });
      box.append(ta, b);
    }
    return box;
  }

  function button(text, cls, onClick) {
    const b = document.createElement('button');
    b.type = 'button';
    b.textContent = text;
    b.className = cls;
    b.addEventListener('click', onClick);
    return b;
  }

  function fillActions(c, i, refs) {
    const m = c.messages[i];
    const acts = [];
    if (!gen.running) {
      if (m.role === 'user') acts.push(button('Edit', 'edit', () => editMessage(c, i, refs)));
      if (m.role === 'assistant' && i === c.messages.length - 1) acts.push(button('Regenerate', 'regenerate', () => regenerate(c)));
      if (m.content) acts.push(button('Copy', 'copy', () => copyText(m.content)));
    }
    refs.actions.replaceChildren(...acts);
  }

  function editMessage(c, i, refs) {
    const ta = document.createElement('textarea');
    ta.className = 'edit';
    ta.value = c.messages[i].content;
    refs.content.replaceWith(ta);
    refs.actions.replaceChildren(
      button('Save & send', 'primary save', () => {
        const text = ta.value.trim();
        if (!text) return;
        c.messages[i].content = text;
        c.messages.length = i + 1;
        if (i === 0) c.title = titleOf(text);
        persist();
        generate(c);
      }),
      button('Cancel', 'cancel', () => renderMessages()),
    );
    ta.focus();
  }

  function regenerate(c) {
    while (c.messages.length && c.messages[c.messages.length - 1].role === 'assistant') c.messages.pop();
    persist();
    generate(c);
  }

  let liveRefs = null;

  function renderMessages() {
    const c = current();
    const box = $('messages');
    liveRefs = null;
    if (!c) {
      box.replaceChildren();
      return;
    }
    const nodes = c.messages.map((_, i) => messageNode(c, i));
    box.replaceChildren(...nodes.map((r) => r.div));
    if (gen.running && nodes.length) liveRefs = nodes[nodes.length - 1];
    box.scrollTop = box.scrollHeight;
  }

  function renderAll() {
    renderList();
    renderMessages();
  }

  const titleOf = (text) => text.replace(/\s+/g, ' ').trim().slice(0, 60);

  // ---------------------------------------------------------------------------------------
  // Generation: one streamed chat completion.

  // The conversation as the API's messages.
  function apiMessages(c) {
    const out = [];
    const system = $('system').value.trim();
    if (system) out.push({ role: 'system', content: system });
    for (const m of c.messages) {
      if (m.role === 'user') out.push({ role: 'user', content: m.content });
      else if (m.role === 'tool') out.push({ role: 'tool', tool_call_id: m.tool_call_id, content: m.content });
      else if (m.role === 'assistant') {
        const calls = (m.tool_calls || []).filter((t) => t.id && t.function && t.function.name);
        if (!m.content && !m.reasoning && !calls.length) continue;
        const a = { role: 'assistant', content: m.content || '' };
        if (m.reasoning) a.reasoning_content = m.reasoning;
        if (calls.length) a.tool_calls = calls.map((t) => ({ id: t.id, type: 'function', function: { name: t.function.name, arguments: t.function.arguments || '' } }));
        out.push(a);
      }
    }
    return out;
  }

  let renderTimer = null;
  function renderLiveSoon() {
    if (renderTimer) return;
    renderTimer = setTimeout(() => {
      renderTimer = null;
      const c = current();
      if (c && liveRefs) {
        fillMessage(c, c.messages.length - 1, liveRefs);
        const box = $('messages');
        if (box.scrollHeight - box.scrollTop - box.clientHeight < 120) box.scrollTop = box.scrollHeight;
      }
    }, 60);
  }

  function onPrefill(done, total) {
    const now = performance.now();
    if (!gen.prefill) gen.prefill = { done, total, firstDone: done, firstAt: now, lastAt: now };
    else Object.assign(gen.prefill, { done, total, lastAt: now });
    if (gen.phase !== 'decode') setPhase('prefill');
    renderPrefill();
  }

  function onDelta(m, delta) {
    if (gen.phase !== 'decode' && (delta.content || delta.reasoning_content || delta.tool_calls)) {
      setPhase('decode');
      gen.firstTokenAt = performance.now();
      gen.prefillSeconds = (gen.firstTokenAt - gen.sentAt) / 1000;
      // The counters when the first token arrived: this answer's cache figures are the
      // difference to the counters at its end.
      pollStatus().then((st) => {
        if (st && !gen.atFirstToken) gen.atFirstToken = st;
      });
    }
    if (delta.reasoning_content) m.reasoning = (m.reasoning || '') + delta.reasoning_content;
    if (delta.content) m.content = (m.content || '') + delta.content;
    if (delta.reasoning_content || delta.content) gen.frames++;
    for (const t of delta.tool_calls || []) {
      m.tool_calls = m.tool_calls || [];
      const k = t.index ?? m.tool_calls.length;
      const slot = (m.tool_calls[k] = m.tool_calls[k] || { id: '', type: 'function', function: { name: '', arguments: '' } });
      if (t.id) slot.id = t.id;
      if (t.function?.name) slot.function.name = t.function.name;
      if (t.function?.arguments) slot.function.arguments += t.function.arguments;
      gen.frames++;
    }
    if (gen.phase === 'decode' && gen.frames > 1) {
      const secs = (performance.now() - gen.firstTokenAt) / 1000;
      if (secs > 0.2) $('decode-rate').textContent = `≈ ${fmtRate((gen.frames - 1) / secs)} (live)`;
    }
    renderLiveSoon();
    persistSoon();
  }

  // Reads the event stream of `resp` into message `m`.
  async function readStream(resp, m) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = '';
    let ended = false;
    const block = (b) => {
      for (const line of b.split('\n')) {
        if (line.startsWith(':')) {
          const p = /^: prefill (\d+)\/(\d+)$/.exec(line);
          if (p) onPrefill(Number(p[1]), Number(p[2]));
        } else if (line.startsWith('data: ')) {
          const data = line.slice(6);
          if (data === '[DONE]') {
            ended = true;
            continue;
          }
          let v;
          try {
            v = JSON.parse(data);
          } catch {
            continue;
          }
          if (v.error) {
            m.error = `The generation failed: ${v.error.code || v.error.type}: ${v.error.message}`;
            ended = true;
            continue;
          }
          if (v.usage) m.usage = v.usage;
          for (const ch of v.choices || []) {
            if (ch.delta) onDelta(m, ch.delta);
            if (ch.finish_reason) m.finish = ch.finish_reason;
          }
        }
      }
    };
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let at;
      while ((at = buf.indexOf('\n\n')) >= 0) {
        block(buf.slice(0, at));
        buf = buf.slice(at + 2);
      }
    }
    if (buf.trim()) block(buf);
    if (!ended && !m.error) m.error = 'The stream ended before the answer did.';
  }

  async function generate(c) {
    if (gen.running) return;
    let fields;
    try {
      fields = settingsFields();
      $('settings-error').hidden = true;
    } catch (e) {
      $('settings-error').textContent = e.message;
      $('settings-error').hidden = false;
      return;
    }
    const body = {
      model: MODEL,
      messages: apiMessages(c),
      stream: true,
      stream_options: { include_usage: true },
      ...fields,
    };
    const m = { role: 'assistant', content: '', reasoning: '' };
    c.messages.push(m);
    c.updated = Date.now();
    Object.assign(gen, {
      running: true,
      controller: new AbortController(),
      prefill: null,
      reused: null,
      frames: 0,
      firstTokenAt: 0,
      prefillSeconds: undefined,
      atHeaders: null,
      atFirstToken: null,
      sentAt: performance.now(),
    });
    setPhase('waiting');
    $('send').disabled = true;
    $('stop').hidden = false;
    $('prefill-bar').value = 0;
    $('prefill-text').textContent = 'waiting for the server…';
    $('reused').textContent = '–';
    $('decode-rate').textContent = '–';
    hideNotice();
    renderAll();
    persist();
    pollStatus();
    const signal = gen.controller.signal;
    try {
      const resp = await api('/v1/chat/completions', { method: 'POST', body: JSON.stringify(body), signal });
      if (!resp.ok) {
        setPhase('refused');
        let err = null;
        try {
          err = await resp.json();
        } catch {
          err = null;
        }
        const text = refusalText(resp.status, err);
        showNotice(text, 'error');
        m.error = text;
      } else {
        hideNotice();
        setPhase('prefill');
        $('prefill-text').textContent = 'prefill starting…';
        gen.atHeaders = lastStatus;
        await readStream(resp, m);
      }
    } catch (e) {
      setPhase('ended');
      if (signal.aborted) {
        m.finish = 'stopped';
        showNotice('Stopped: the connection was closed, and the server cancels the generation at once.');
      } else {
        m.error = `The request failed: ${e.message}`;
        showNotice(m.error, 'error');
      }
    }
    await finish(c, m);
  }

  async function finish(c, m) {
    const st = await pollStatus().catch(() => null);
    const stats = {};
    if (gen.prefillSeconds !== undefined) stats.prefill_seconds = gen.prefillSeconds;
    if (gen.reused !== null) stats.reused = gen.reused;
    else if (st && gen.atHeaders && m.usage) stats.reused = st.totals.prefix_reused_tokens - gen.atHeaders.totals.prefix_reused_tokens;
    if (st && m.usage && !m.error && m.finish !== 'stopped') {
      stats.decode_tps = st.last_generation.decode_tokens_per_second;
      const a = gen.atFirstToken?.experts.host;
      const b = st.experts.host;
      if (a && b) {
        const dh = b.hits - a.hits;
        const dm = b.misses - a.misses;
        stats.hit_ratio = dh + dm > 0 ? dh / (dh + dm) : null;
        const tokens = m.usage.completion_tokens - 1;
        stats.bytes_per_token = tokens > 0 ? (b.read_bytes - a.read_bytes) / tokens : null;
        $('expert-bytes').textContent = stats.bytes_per_token === null ? '–' : `${fmtBytes(stats.bytes_per_token)}/token (last answer)`;
      }
      if (stats.decode_tps > 0) $('decode-rate').textContent = `${fmtRate(stats.decode_tps)} (last answer)`;
    }
    m.stats = stats;
    if (stats.reused !== undefined) $('reused').textContent = `${stats.reused.toLocaleString()} tokens (last answer)`;
    if (gen.prefill && gen.prefill.done < gen.prefill.total) $('prefill-text').textContent += ' · stopped';
    else if (!gen.prefill) $('prefill-text').textContent = 'idle';
    Object.assign(gen, { running: false, controller: null });
    setPhase('idle');
    $('send').disabled = false;
    $('stop').hidden = true;
    persist();
    renderAll();
  }

  function stop() {
    if (gen.controller) gen.controller.abort();
  }

  function send() {
    const text = $('input').value.trim();
    if (!text || gen.running) return;
    const c = current() || newConversation();
    if (!c.title) c.title = titleOf(text);
    c.messages.push({ role: 'user', content: text });
    $('input').value = '';
    persist();
    generate(c);
  }

  // ---------------------------------------------------------------------------------------
  // The last benchmark.

  async function showBenchmark() {
    const d = $('bench-dialog');
    $('bench-error').hidden = true;
    $('bench-table').replaceChildren();
    $('bench-name').textContent = '';
    const img = $('bench-plot');
    img.hidden = true;
    if (img.src.startsWith('blob:')) URL.revokeObjectURL(img.src);
    d.showModal();
    try {
      const resp = await api('/v1/benchmark');
      const v = await resp.json();
      if (!resp.ok) throw new Error(v.error ? v.error.message : `HTTP ${resp.status}`);
      $('bench-name').textContent = `${v.directory} · ${new Date(v.modified * 1000).toLocaleString()}`;
      const r = v.result || {};
      const rows = [['arm', 'valid runs', 'prefill s (median)', 'decode tok/s (median)', 'vs first']];
      for (const a of r.arms || []) {
        const med = (s) => (s && typeof s.median === 'number' ? s.median.toFixed(3) : '–');
        const rel = a.relative_to_first_config?.decode_tokens_per_second_median;
        rows.push([a.name, `${a.valid_runs}/${a.runs}`, med(a.prefill_seconds), med(a.decode_tokens_per_second), typeof rel === 'number' ? `${rel.toFixed(3)}×` : '–']);
      }
      $('bench-table').replaceChildren(...rows.map((cells, i) => {
        const tr = document.createElement('tr');
        tr.replaceChildren(...cells.map((t) => {
          const td = document.createElement(i === 0 ? 'th' : 'td');
          td.textContent = String(t);
          return td;
        }));
        return tr;
      }));
      const caption = document.createElement('caption');
      caption.textContent = `all runs valid: ${r.all_runs_valid} · all outputs exact: ${r.all_outputs_exact}`;
      $('bench-table').prepend(caption);
      if (v.plot) {
        const p = await api(v.plot);
        if (p.ok) {
          img.src = URL.createObjectURL(await p.blob());
          img.hidden = false;
        }
      }
    } catch (e) {
      $('bench-error').textContent = e.message;
      $('bench-error').hidden = false;
    }
  }

  // ---------------------------------------------------------------------------------------
  // Wiring.

  function start() {
    loadSettings();
    for (const id of SETTING_IDS) $(id).addEventListener('change', saveSettings);
    $('send').addEventListener('click', send);
    $('stop').addEventListener('click', stop);
    $('input').addEventListener('keydown', (e) => {
      if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        send();
      }
    });
    $('new-chat').addEventListener('click', () => {
      if (gen.running) return;
      newConversation();
      renderAll();
      $('input').focus();
    });
    $('key-save').addEventListener('click', saveKey);
    $('key-input').addEventListener('keydown', (e) => {
      if (e.key === 'Enter') saveKey();
    });
    $('key-dialog').addEventListener('cancel', (e) => e.preventDefault());
    $('forget-key').hidden = !apiKey;
    $('forget-key').addEventListener('click', () => {
      apiKey = '';
      localStorage.removeItem(STORE.key);
      $('forget-key').hidden = true;
    });
    $('show-benchmark').addEventListener('click', showBenchmark);
    $('bench-close').addEventListener('click', () => $('bench-dialog').close());
    // Another tab of this page changed the conversations: show them (unless an answer is
    // streaming here; this tab's next save then keeps its own).
    window.addEventListener('storage', (e) => {
      if (e.key !== STORE.conversations || gen.running) return;
      const fresh = load(STORE.conversations, []);
      if (!Array.isArray(fresh)) return;
      conversations = fresh;
      if (!current()) currentId = conversations[0]?.id ?? null;
      renderAll();
    });
    if (!current() && conversations.length) currentId = conversations[0].id;
    // An answer that was streaming when the page was closed ended then.
    for (const c of conversations) {
      const last = c.messages[c.messages.length - 1];
      if (last && last.role === 'assistant' && !last.finish && !last.error && !last.usage) last.finish = 'stopped';
    }
    renderAll();
    pollStatus();
    $('input').focus();
  }

  start();
})();
