'use strict';
/**
 * tablemail-nodemailer against Nodemailer and pg from npm, a real PostgreSQL
 * and the real daemon (DESIGN §17): what arrives at the SMTP server through
 * tablemail is what Nodemailer's own SMTP transport sends for the same
 * message; the mail is part of the caller's transaction; what tablemail
 * would refuse is refused before anything is written.
 */

const assert = require('node:assert/strict');
const { spawnSync } = require('node:child_process');
const fs = require('node:fs');
const path = require('node:path');
const { test } = require('node:test');
const nodemailer = require('nodemailer');
const { Pool } = require('pg');

const tablemailTransport = require('..');
const { REPO, compareDeliveries, daemon, database, eventually, messageIdOf, smtpServer, tempDir } = require('./support');

const PNG = Buffer.from('89504e470d0a1a0a0000000d4948445200000001000000010806000000', 'hex');
const PDF = Buffer.concat([Buffer.from('%PDF-1.4\n%\xe4\xfc\n', 'latin1'), Buffer.from([...Array(256).keys()])]);

/** Every field the transport maps: names with commas and umlauts, cc, bcc,
 * reply-to, a non-ASCII subject, text and HTML, files (a Buffer, a string,
 * base64, one from disk), an inline image, extra headers, a priority,
 * In-Reply-To and References. */
function fullMessage() {
    return {
        from: '"Shop, Inc." <orders@shop.example>',
        to: ['Ann Example <ann@example.org>', { name: 'Doe, John', address: 'john@example.net' }],
        // A display name that tries to smuggle in a recipient.
        cc: ['Jörg <joerg@example.com>', { name: 'Eve" <x@evil.example>, "', address: 'eve@example.com' }],
        bcc: 'audit@example.com',
        replyTo: 'help@shop.example',
        subject: 'Grüße: your order 42',
        text: 'Hello Ann,\n\nyour order 42 is on its way.\nÄrger? Reply.\n',
        html: '<p>Hello <b>Ann</b></p><img src="cid:logo@shop.example">',
        headers: {
            'X-Campaign': 'spring',
            'List-Unsubscribe': '<https://shop.example/u/42>',
            'X-Note': 'Grüße aus Köln'
        },
        priority: 'high',
        inReplyTo: '<order-41@shop.example>',
        references: ['<order-40@shop.example>', '<order-41@shop.example>'],
        attachments: [
            { filename: 'invoice-42.pdf', content: PDF },
            { filename: 'notes.txt', content: 'line one\nline two: é\n' },
            { filename: 'résumé 2024.bin', content: 'AAEC/w==', encoding: 'base64' },
            { path: path.join(REPO, 'LICENSE-MIT') },
            { filename: 'logo.png', content: PNG, cid: 'logo@shop.example' }
        ]
    };
}

function htmlOnlyMessage() {
    return {
        from: 'Shop <orders@shop.example>',
        to: 'ann@example.org',
        subject: 'HTML only',
        html: '<h1>Hi</h1><p>Only HTML here.</p>',
        priority: 'low'
    };
}

function plainMessage() {
    return { from: 'orders@shop.example', to: 'bob@example.net', subject: 'Plain', text: 'Just text.' };
}

const allMessages = () => [fullMessage(), htmlOnlyMessage(), plainMessage()];

test('a delivery through tablemail matches Nodemailer’s own SMTP transport', async t => {
    const db = await database(t);
    if (!db) {
        return;
    }
    const dir = tempDir(t);
    const direct = await smtpServer(t, dir);
    const relayed = await smtpServer(t, dir);

    const smtp = nodemailer.createTransport({ host: '127.0.0.1', port: direct.port, secure: false, ignoreTLS: true });
    for (const message of allMessages()) {
        await smtp.sendMail(message);
    }
    smtp.close();

    const transporter = nodemailer.createTransport(tablemailTransport({ query: (sql, params) => db.client.query(sql, params) }));
    await db.client.query('BEGIN');
    const infos = [];
    for (const message of allMessages()) {
        infos.push(await transporter.sendMail(message));
    }
    await db.client.query('COMMIT');
    assert.equal(new Set(infos.map(i => i.tablemailId)).size, 3);
    assert.equal(await db.count('mail_attachment'), 5);
    assert.deepEqual(infos[0].envelope, {
        from: 'orders@shop.example',
        to: ['ann@example.org', 'john@example.net', 'joerg@example.com', 'eve@example.com', 'audit@example.com']
    });

    const running = daemon(t, dir, db.url, relayed.port);
    await direct.waitFor(3);
    let received;
    try {
        received = await relayed.waitFor(3);
    } catch (e) {
        console.log(running.output());
        throw e;
    }
    assert.deepEqual(compareDeliveries(direct.out, relayed.out), []);

    const stored = (await db.client.query('SELECT id, message_id FROM mail_queue ORDER BY id')).rows;
    assert.deepEqual(
        stored.map(r => [Number(r.id), r.message_id]),
        infos.map(i => [i.tablemailId, i.messageId])
    );
    assert.deepEqual(received.map(messageIdOf).sort(), infos.map(i => i.messageId).sort());
    await eventually('every row sent', async () => {
        const { rows } = await db.client.query("SELECT count(*) AS n FROM mail_queue WHERE status = 'sent'");
        return Number(rows[0].n) === 3;
    });
});

test('a rolled-back transaction leaves no row', async t => {
    const db = await database(t);
    if (!db) {
        return;
    }
    const transporter = nodemailer.createTransport(tablemailTransport({ query: (sql, params) => db.client.query(sql, params) }));
    await db.client.query('BEGIN');
    const info = await transporter.sendMail(fullMessage());
    assert.ok(info.tablemailId > 0);
    assert.equal(await db.count('mail_queue'), 1);
    await db.client.query('ROLLBACK');
    assert.equal(await db.count('mail_queue'), 0);
    assert.equal(await db.count('mail_attachment'), 0);
});

test('what tablemail would refuse is refused before anything is written', async t => {
    const db = await database(t);
    if (!db) {
        return;
    }
    let queries = 0;
    const transporter = nodemailer.createTransport(
        tablemailTransport({
            query: (sql, params) => {
                queries += 1;
                return db.client.query(sql, params);
            }
        })
    );
    const cases = [
        [m => ({ ...m, to: [], cc: [], bcc: [] }), /No recipients/, 'EENVELOPE'],
        [m => ({ ...m, to: undefined, cc: undefined, bcc: undefined }), /No recipients/, 'EENVELOPE'],
        [m => ({ ...m, headers: { Sender: 'ceo@shop.example' } }), /"Sender" is reserved/],
        [m => ({ ...m, headers: { Received: 'from evil' } }), /"Received" is reserved/],
        [m => ({ ...m, headers: { 'Resent-To': 'x@evil.example' } }), /"Resent-To" is reserved/],
        [m => ({ ...m, headers: { 'reply-to': 'x@evil.example' } }), /"reply-to" is reserved/],
        [m => ({ ...m, headers: { 'Message-ID': '<a@b>' } }), /"Message-ID" is reserved/],
        [m => ({ ...m, headers: [{ key: 'DKIM-Signature', value: 'v=1' }] }), /"DKIM-Signature" is reserved/],
        [m => ({ ...m, headers: { 'X-Ok': 'fine\r\nBcc: x@evil.example' } }), /header "X-Ok" may not contain CR, LF/],
        [m => ({ ...m, headers: { 'X-Bad\nBcc': 'x' } }), /X-Bad/],
        [m => ({ ...m, headers: { 'X-Twice': ['a', 'b'] } }), /"X-Twice" is given 2 times/],
        [m => ({ ...m, subject: 'Hi\r\nBcc: x@evil.example' }), /subject may not contain CR, LF/],
        [m => ({ ...m, sender: 'ceo@shop.example' }), /cannot send "sender"/],
        [m => ({ ...m, envelope: { from: 'a@b.example', to: 'c@d.example' } }), /cannot send "envelope"/],
        [m => ({ ...m, priority: 'urgent' }), /priority must be high, normal or low/],
        [m => ({ ...m, messageId: 'not an id' }), /messageId .* is not <id@domain>/],
        [m => ({ ...m, tablemail: { sentAt: new Date() } }), /unknown key "sentAt"/],
        [m => ({ ...m, tablemail: { sendAt: 'tomorrow' } }), /sendAt must be a valid Date/]
    ];
    for (const [change, message, code] of cases) {
        await assert.rejects(transporter.sendMail(change(fullMessage())), err => {
            assert.match(err.message, message);
            if (code) {
                assert.equal(err.code, code);
            }
            return true;
        });
    }
    assert.equal(queries, 0);
    assert.equal(await db.count('mail_queue'), 0);
    assert.equal(await db.count('mail_attachment'), 0);
});

test('tablemail options, priorities, dedupe keys and a pool in autocommit', async t => {
    const db = await database(t);
    if (!db) {
        return;
    }
    const pool = new Pool({ connectionString: db.url, max: 2 });
    try {
        await optionsOnPool(db, pool);
    } finally {
        await pool.end();
    }
});

async function optionsOnPool(db, pool) {
    const transporter = nodemailer.createTransport(tablemailTransport({ query: (sql, params) => pool.query(sql, params) }));
    const sendAt = new Date('2031-05-06T05:08:09.250Z');
    const message = () => ({
        ...fullMessage(),
        messageId: 'order-42@shop.example',
        tablemail: { sendAt, dedupeKey: 'order-42-confirmation', bypassSuppression: true }
    });
    const first = await transporter.sendMail(message());
    const again = await transporter.sendMail(message());
    assert.equal(first.messageId, '<order-42@shop.example>');
    assert.equal(first.duplicate, false);
    assert.equal(again.duplicate, true);
    assert.equal(again.tablemailId, first.tablemailId);
    assert.equal(await db.count('mail_queue'), 1);
    assert.equal(await db.count('mail_attachment'), 5);

    const [row] = (
        await db.client.query(
            'SELECT priority, send_at, dedupe_key, bypass_suppression, from_name, to_address, headers, message_id FROM mail_queue'
        )
    ).rows;
    assert.equal(row.priority, 10);
    assert.equal(row.send_at.toISOString(), sendAt.toISOString());
    assert.equal(row.dedupe_key, 'order-42-confirmation');
    assert.equal(row.bypass_suppression, true);
    assert.equal(row.from_name, 'Shop, Inc.');
    assert.equal(row.to_address, '"Ann Example" <ann@example.org>, "Doe, John" <john@example.net>');
    assert.equal(row.message_id, '<order-42@shop.example>');
    assert.equal(row.headers['X-Priority'], '1 (Highest)');
    assert.equal(row.headers.References, '<order-40@shop.example> <order-41@shop.example>');

    const files = (await db.client.query('SELECT filename, content_type, content, content_id FROM mail_attachment ORDER BY id')).rows;
    assert.deepEqual(
        files.map(f => [f.filename, f.content_type, f.content_id]),
        [
            ['invoice-42.pdf', 'application/pdf', null],
            ['notes.txt', 'text/plain; charset=utf-8', null],
            ['résumé 2024.bin', 'application/octet-stream', null],
            ['LICENSE-MIT.*', 'application/octet-stream', null], // Nodemailer's own name for it
            ['logo.png', 'image/png', 'logo@shop.example']
        ]
    );
    assert.deepEqual(files[0].content, PDF);
    assert.deepEqual(files[2].content, Buffer.from([0, 1, 2, 255]));

    const low = await transporter.sendMail(htmlOnlyMessage());
    const { rows } = await db.client.query('SELECT priority, body, body_html FROM mail_queue WHERE id = $1', [low.tablemailId]);
    assert.deepEqual(rows[0], { priority: -10, body: null, body_html: '<h1>Hi</h1><p>Only HTML here.</p>' });
    assert.equal(await transporter.verify(), true);
}

test('npm packs the package and installs it from the tarball', t => {
    const dir = tempDir(t);
    const pack = spawnSync('npm', ['pack', '--json', '--pack-destination', dir], {
        cwd: path.join(__dirname, '..'),
        encoding: 'utf8'
    });
    assert.equal(pack.status, 0, pack.stderr);
    const [packed] = JSON.parse(pack.stdout);
    assert.deepEqual(packed.files.map(f => f.path).sort(), ['README.md', 'index.d.ts', 'index.js', 'package.json']);
    const app = path.join(dir, 'app');
    fs.mkdirSync(app);
    fs.writeFileSync(path.join(app, 'package.json'), '{"name": "app", "version": "1.0.0", "private": true}');
    const install = spawnSync(
        'npm',
        ['install', '--no-audit', '--no-fund', '--legacy-peer-deps', path.join(dir, packed.filename)],
        { cwd: app, encoding: 'utf8' }
    );
    assert.equal(install.status, 0, install.stderr);
    const load = spawnSync(process.execPath, ['-e', "console.log(typeof require('tablemail-nodemailer'))"], {
        cwd: app,
        encoding: 'utf8'
    });
    assert.equal(load.stdout.trim(), 'function', load.stderr);
});
