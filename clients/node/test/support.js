'use strict';
/**
 * What the transport's tests run against: a fresh PostgreSQL database per
 * test (migrated by `tablemail migrate`, dropped afterwards), SMTP servers
 * that record what they receive (tests/support/smtp_server.py), the tablemail
 * daemon, and the comparison of two deliveries part by part
 * (tests/support/mail_compare.py).
 *
 * An unreachable database or a missing daemon binary fails the test;
 * TABLEMAIL_TEST_SKIP_UNREACHABLE=1 turns that into a skip, never under
 * CI=true, as in the Rust tests. TABLEMAIL_TEST_POSTGRES names another
 * server, TABLEMAIL_TEST_BIN another build of the daemon.
 */

const { spawn, spawnSync } = require('child_process');
const crypto = require('crypto');
const fs = require('fs');
const os = require('os');
const path = require('path');
const readline = require('readline');
const { Client } = require('pg');

const REPO = path.resolve(__dirname, '..', '..', '..');
const PYTHON = process.env.PYTHON || 'python3';

function adminUrl() {
    return process.env.TABLEMAIL_TEST_POSTGRES || 'postgres://postgres@127.0.0.1:5432/postgres';
}

function unavailable(t, what) {
    if (process.env.TABLEMAIL_TEST_SKIP_UNREACHABLE === '1' && process.env.CI !== 'true') {
        t.skip(`SKIPPED: ${what}`);
        return null;
    }
    throw new Error(`${what} (scripts/test starts the servers; TABLEMAIL_TEST_SKIP_UNREACHABLE=1 skips instead, outside CI)`);
}

function tablemailBin() {
    let bin = process.env.TABLEMAIL_TEST_BIN;
    if (!bin) {
        const target = process.env.CARGO_TARGET_DIR || path.join(REPO, 'target');
        bin = path.join(target, 'debug', 'tablemail');
    }
    bin = path.resolve(REPO, bin);
    if (!fs.existsSync(bin)) {
        throw new Error(`the daemon ${bin} is not built: run \`cargo build\` first`);
    }
    return bin;
}

/** Polls `check` until it returns something truthy, failing after `limit` ms. */
async function eventually(what, check, limit = 20000) {
    const deadline = Date.now() + limit;
    for (;;) {
        const found = await check();
        if (found) {
            return found;
        }
        if (Date.now() >= deadline) {
            throw new Error(`timed out after ${limit} ms waiting for: ${what}`);
        }
        await new Promise(resolve => setTimeout(resolve, 50));
    }
}

/** A temporary directory, removed after the test. */
function tempDir(t) {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'tablemail-node-'));
    t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
    return dir;
}

function withDatabase(url, name) {
    const u = new URL(url);
    u.pathname = '/' + name;
    return u.toString();
}

async function admin(sql) {
    const client = new Client({ connectionString: adminUrl(), connectionTimeoutMillis: 5000 });
    await client.connect();
    try {
        await client.query(sql);
    } finally {
        await client.end();
    }
}

/**
 * A database of its own for this test, migrated: `{ url, client, count }`,
 * `client` a connected pg Client. Null when skipped.
 */
async function database(t) {
    const name = 'tm_test_' + crypto.randomUUID().replace(/-/g, '');
    try {
        await admin(`CREATE DATABASE ${name}`);
    } catch (e) {
        return unavailable(t, `PostgreSQL is unreachable at ${adminUrl()}: ${e.message}`);
    }
    const url = withDatabase(adminUrl(), name);
    const clients = [];
    t.after(async () => {
        for (const c of clients) {
            await c.end().catch(() => {});
        }
        await admin(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
    });
    const migrate = spawnSync(tablemailBin(), ['migrate'], {
        env: { ...process.env, TABLEMAIL__DATABASE__URL: url },
        cwd: os.tmpdir(),
        encoding: 'utf8',
        timeout: 60000
    });
    if (migrate.status !== 0) {
        throw new Error(`tablemail migrate failed: ${migrate.stdout}${migrate.stderr}`);
    }
    const client = new Client({ connectionString: url });
    await client.connect();
    clients.push(client);
    const count = async table => Number((await client.query(`SELECT count(*) AS n FROM ${table}`)).rows[0].n);
    return { url, client, count };
}

/** tests/support/smtp_server.py: a real SMTP server recording what it accepts. */
async function smtpServer(t, dir) {
    const out = path.join(dir, `smtp-${crypto.randomUUID()}.jsonl`);
    const child = spawn(PYTHON, [path.join(REPO, 'tests', 'support', 'smtp_server.py'), '--out', out], {
        stdio: ['ignore', 'pipe', 'inherit']
    });
    t.after(() => child.kill('SIGTERM'));
    const lines = readline.createInterface({ input: child.stdout });
    const first = await new Promise((resolve, reject) => {
        lines.once('line', resolve);
        child.once('exit', code => reject(new Error(`the SMTP server exited (${code}): is aiosmtpd installed?`)));
    });
    if (!first.startsWith('PORT ')) {
        throw new Error(`the SMTP server did not start: ${first}`);
    }
    const records = () =>
        fs
            .readFileSync(out, 'utf8')
            .split('\n')
            .filter(l => l.trim())
            .map(l => JSON.parse(l));
    return {
        port: Number(first.split(' ')[1]),
        out,
        records,
        waitFor: count => eventually(`${count} mails at the SMTP server`, () => records().length >= count && records())
    };
}

/** `tablemail run` on a database, sending to an SMTP server. */
function daemon(t, dir, url, smtpPort) {
    const log = path.join(dir, `daemon-${crypto.randomUUID()}.log`);
    const fd = fs.openSync(log, 'w');
    const child = spawn(tablemailBin(), ['run'], {
        cwd: dir,
        env: {
            ...process.env,
            TABLEMAIL__DATABASE__URL: url,
            TABLEMAIL__TRANSPORT__URL: `smtp://127.0.0.1:${smtpPort}`,
            TABLEMAIL__DEFAULTS__FROM_ADDRESS: 'tablemail@shop.example',
            TABLEMAIL__WORKER__POLL_INTERVAL: '200ms'
        },
        stdio: ['ignore', fd, fd]
    });
    const exited = new Promise(resolve => child.once('exit', resolve));
    t.after(async () => {
        if (child.exitCode === null) {
            child.kill('SIGTERM');
            const timer = setTimeout(() => child.kill('SIGKILL'), 30000);
            await exited;
            clearTimeout(timer);
        }
        fs.closeSync(fd);
    });
    return { output: () => fs.readFileSync(log, 'utf8') };
}

/** The differences between two SMTP servers' mails, paired by subject. */
function compareDeliveries(expectedFile, actualFile) {
    const run = spawnSync(PYTHON, [path.join(REPO, 'tests', 'support', 'mail_compare.py'), expectedFile, actualFile], {
        encoding: 'utf8'
    });
    if (run.status !== 0 && run.status !== 1) {
        throw new Error(`mail_compare.py failed: ${run.stderr}`);
    }
    return run.stdout.split('\n').filter(l => l.trim());
}

/** The Message-ID header of a received mail. */
function messageIdOf(record) {
    const m = /^Message-ID:\s*(\S+)/im.exec(record.data);
    return m && m[1];
}

module.exports = {
    REPO,
    compareDeliveries,
    daemon,
    database,
    eventually,
    messageIdOf,
    smtpServer,
    tempDir
};
