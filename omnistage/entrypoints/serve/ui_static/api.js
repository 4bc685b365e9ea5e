// The server's routes as the page calls them: every call carries the key the user typed
// (Authorization: Bearer), kept in this tab's sessionStorage only; a 401 asks for it again.
// Answers come back as they are (status, JSON or text): the page shows them, it never
// rewrites the server's words.

const API_KEY = "omnistage.apiKey";
const CONTROL_KEY = "omnistage.controlKey";

// The server's root, seen from /ui/ (relative, so a proxy's path prefix keeps working).
export const root = new URL("../", location.href);

export const keys = {
  get api() {
    return sessionStorage.getItem(API_KEY) || "";
  },
  // The control routes take the control key, or the API key where the server has no other.
  get control() {
    return sessionStorage.getItem(CONTROL_KEY) || this.api;
  },
  get ownControl() {
    return sessionStorage.getItem(CONTROL_KEY) || "";
  },
  set(api, control) {
    for (const [name, value] of [[API_KEY, api], [CONTROL_KEY, control]]) {
      if (value) sessionStorage.setItem(name, value);
      else sessionStorage.removeItem(name);
    }
  },
};

const listeners = new Set();

// fn({control, status, body}) on every 401 to a call sent with the keys the tab has now: the
// page opens its login prompt. A 401 to a call sent before the user typed new keys (the
// page's first calls, answered after the user signed in) asks for nothing.
export function onUnauthorized(fn) {
  listeners.add(fn);
}

function headers(control, json) {
  const out = {};
  const key = control ? keys.control : keys.api;
  if (key) out.Authorization = `Bearer ${key}`;
  if (json) out["Content-Type"] = "application/json";
  return out;
}

// One call: {ok, status, body (parsed JSON or null), text, error (network failure)}.
export async function call(path, { method = "GET", body, control = false, signal } = {}) {
  const sentWith = control ? keys.control : keys.api;
  let response;
  try {
    response = await fetch(new URL(path, root), {
      method,
      headers: headers(control, body !== undefined),
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
      cache: "no-store",
    });
  } catch (error) {
    return { ok: false, status: 0, body: null, text: "", error: String(error) };
  }
  const text = await response.text();
  let parsed = null;
  try {
    parsed = text ? JSON.parse(text) : null;
  } catch {
    parsed = null;
  }
  const answer = { ok: response.ok, status: response.status, body: parsed, text };
  const current = (control ? keys.control : keys.api) === sentWith;
  if (response.status === 401 && current) for (const fn of listeners) fn({ control, ...answer });
  return answer;
}

// A streamed call (text/event-stream): the Response, or an answer as call() gives it.
export async function stream(path, body, signal) {
  const sentWith = keys.api;
  let response;
  try {
    response = await fetch(new URL(path, root), {
      method: "POST",
      headers: headers(false, true),
      body: JSON.stringify(body),
      signal,
      cache: "no-store",
    });
  } catch (error) {
    return { ok: false, status: 0, body: null, text: "", error: String(error) };
  }
  const type = response.headers.get("content-type") || "";
  if (response.ok && type.startsWith("text/event-stream")) return { ok: true, response };
  const text = await response.text();
  let parsed = null;
  try {
    parsed = JSON.parse(text);
  } catch {
    parsed = null;
  }
  const answer = { ok: response.ok, status: response.status, body: parsed, text };
  if (response.status === 401 && keys.api === sentWith) {
    for (const fn of listeners) fn({ control: false, ...answer });
  }
  return answer;
}

// The data of each server-sent event of a Response, as text, until the stream ends.
export async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value.replaceAll("\r\n", "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) yield data;
    }
  }
}

// "HTTP 400" and the server's body as it came (pretty-printed when it is JSON).
export function describe(answer) {
  if (answer.status === 0) return `no answer from the server: ${answer.error}`;
  const body = answer.body !== null ? JSON.stringify(answer.body, null, 2) : answer.text;
  return `HTTP ${answer.status}\n${body}`;
}

// The server's own message of an error answer (OpenAI's error.message, FastAPI's detail).
export function message(answer) {
  if (answer.status === 0) return answer.error;
  const body = answer.body;
  if (body && typeof body === "object") {
    if (body.error && typeof body.error === "object" && body.error.message) return body.error.message;
    if (typeof body.detail === "string") return body.detail;
    if (body.reason) return body.reason;
  }
  return answer.text.slice(0, 300);
}
