// The page's start: the login prompt (keys typed here, kept in this tab only), then the
// console and the playground. Nothing is shown before the server answered with data.
import { call, keys, message, onUnauthorized } from "./api.js";
import { Console } from "./console.js";
import { Playground } from "./playground.js";

const $ = (selector) => document.querySelector(selector);

const login = $("#login");
const status = $("#connection");
let console_ = null;
let playground = null;

function setStatus(kind, text) {
  status.dataset.kind = kind;
  status.textContent = text;
}

function askForKeys(reason) {
  $("#login-reason").textContent = reason;
  if (login.open) return; // a poll's 401 while the user types: keep what they typed
  $("#api-key").value = keys.api;
  $("#control-key").value = keys.ownControl;
  login.showModal();
  $("#api-key").focus();
}

onUnauthorized(({ control, body, text }) => {
  const which = control ? "The control routes" : "The server";
  const said = body?.error?.message || body?.detail || text;
  setStatus("locked", "key needed");
  askForKeys(`${which} answered 401: ${said}`);
});

async function connect() {
  setStatus("connecting", "connecting…");
  const [models, stages] = await Promise.all([call("v1/models"), call("v1/omni/stages", { control: true })]);
  if (models.status === 401 || stages.status === 401) return; // the login prompt is open
  if (!models.ok) {
    setStatus("error", `v1/models: ${message(models)}`);
    return;
  }
  const card = models.body.data[0];
  $("#model-name").textContent = card ? card.id : "";
  document.title = card ? `omnistage · ${card.id}` : "omnistage";
  playground.setModel(card);
  console_.start(); // it shows what the control routes answer, an error included
}

async function start() {
  const vocabulary = await (await fetch("vocabulary.json", { cache: "no-store" })).json();
  console_ = new Console($("#console"), vocabulary);
  console_.onStatus = setStatus;
  playground = new Playground($("#playground"));
  $("#login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    keys.set($("#api-key").value.trim(), $("#control-key").value.trim());
    login.close();
    connect();
  });
  $("#login-cancel").addEventListener("click", () => login.close());
  $("#keys-button").addEventListener("click", () => askForKeys("Keys are kept in this browser tab only."));
  $("#sign-in").addEventListener("click", () => askForKeys("The control routes need the control key."));
  connect();
}

start();
